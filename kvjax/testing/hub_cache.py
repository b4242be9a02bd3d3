"""A Hugging Face hub cache laid out on disk, with tiny models, for tests that run offline.

    <hub cache>/models--org--name/
        refs/main                       the commit the branch points at
        snapshots/<commit>/config.json  the files of that commit (plain files here; the hub's
        snapshots/<commit>/...          own cache links them to blobs/, which readers ignore)

huggingface_hub's `snapshot_download(..., local_files_only=True)` (or with `HF_HUB_OFFLINE=1`)
returns the snapshot folder of a cached revision, so `kvjax.models.loading.hub` runs against this
layout exactly as against a cache the hub filled.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvjax.models.nn import config as config_lib
from kvjax.models.loading import safetensors_loader
from kvjax.models.nn.config import LlamaConfig
from kvjax.models.loading.registry import tiny_params

#: The tiny chat model's special tokens (ids 256 and 257, after the 256 bytes).
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
#: ChatML, as SmolLM2's tokenizer_config.json has it (without the default system prompt).
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def tiny_chat_config() -> LlamaConfig:
  """`config.tiny()` with a vocabulary of the 256 bytes and `SPECIAL_TOKENS`."""
  return config_lib.tiny(name="tiny-chat", vocab_size=256 + len(SPECIAL_TOKENS))


def _byte_chars() -> list[str]:
  """The character byte-level BPE writes for each byte 0..255 (GPT-2's `bytes_to_unicode`:
  printable bytes stand for themselves, the others are shifted past 255)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  chars, shift = [], 0
  for b in range(256):
    if b in printable:
      chars.append(chr(b))
    else:
      chars.append(chr(256 + shift))
      shift += 1
  return chars


def write_byte_tokenizer(folder: str) -> None:
  """Writes tokenizer.json (byte-level BPE over the 256 bytes, no merges, `SPECIAL_TOKENS`
  added) and tokenizer_config.json (ChatML template, `<|im_end|>` as EOS) into `folder`."""
  vocab = {ch: b for b, ch in enumerate(_byte_chars())}  # id = the byte's value
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  tok.save(os.path.join(folder, "tokenizer.json"))
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": None, "eos_token": SPECIAL_TOKENS[1], "add_bos_token": False,
               "chat_template": CHAT_TEMPLATE}, f)


def write_tiny_checkpoint(folder: str, *, architectures: list[str] | None = None,
                          max_shard_bytes: int | None = None) -> LlamaConfig:
  """A complete tiny chat checkpoint in `folder`: config.json, safetensors (f32, seed 0
  weights of `tiny_chat_config`), tokenizer.json and tokenizer_config.json.

  Args:
    folder: created if needed.
    architectures: overrides config.json's `architectures` (e.g. one kvjax does not run).
    max_shard_bytes: as `safetensors_loader.save_safetensors` (sharded, with an index).

  Returns:
    The model's config.
  """
  cfg = tiny_chat_config()
  safetensors_loader.save_safetensors(folder, cfg, tiny_params(cfg),
                                      max_shard_bytes=max_shard_bytes)
  if architectures is not None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
      hf = json.load(f)
    hf["architectures"] = architectures
    with open(path, "w") as f:
      json.dump(hf, f)
  write_byte_tokenizer(folder)
  return cfg


def snapshot_dir(hub_cache: str, repo_id: str, commit: str) -> str:
  """`<hub_cache>/models--org--name/snapshots/<commit>`, huggingface_hub's folder for it."""
  return os.path.join(hub_cache, "models--" + repo_id.replace("/", "--"), "snapshots", commit)


def add_snapshot(hub_cache: str, repo_id: str, commit: str, *, ref: str | None = "main",
                 **checkpoint) -> str:
  """Lays a tiny checkpoint (`write_tiny_checkpoint(**checkpoint)`) into `hub_cache` as
  `repo_id`'s commit `commit` (40 hex digits), pointed at by branch or tag `ref` (None: none).

  Returns:
    The snapshot folder.
  """
  folder = snapshot_dir(hub_cache, repo_id, commit)
  write_tiny_checkpoint(folder, **checkpoint)
  if ref is not None:
    refs = os.path.join(hub_cache, "models--" + repo_id.replace("/", "--"), "refs")
    os.makedirs(refs, exist_ok=True)
    with open(os.path.join(refs, ref), "w") as f:
      f.write(commit)
  return folder
