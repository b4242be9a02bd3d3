"""Generate tiny random checkpoints of each model family with transformers, plus references.

The sibling of `scripts/make_reference_fixtures.py` (SmolLM2) for the families kvjax runs beside
it in one model: LLaMA (with LLaMA-3 rope scaling), Mistral (a sliding window shorter than its
positions, MQA), Qwen2 (q/k/v biases, tied embeddings) and Qwen3 (per-head q/k RMSNorm, an
explicit head_dim wider than d_model / heads, sharded safetensors). Each is a 2-layer model with
hidden size 64 and a 384-token BPE vocabulary trained on a book, whose weights are drawn at
random (norms and biases too, so every switch shows) and rounded to bfloat16, saved by
transformers' own `save_pretrained` as bfloat16 (so kvjax reads the exact weights transformers
ran in float32).

Outputs, under --out_dir (default tests/testdata/families), one folder per family:
  <family>/            config.json, generation_config.json, model.safetensors (or shards and
                       model.safetensors.index.json), tokenizer.json, tokenizer_config.json
                       (chat template, special tokens)
  <family>_reference.npz   prompt ids, last-position logits, greedy ids and top1-top2 gaps
  references.json      versions, how the references were made, chat-template renderings

Only this script uses torch/transformers; the tests read the files. Run it with the CPU build of
torch in any environment with transformers:

  pip install torch==2.13.0 transformers tokenizers numpy absl-py
  python scripts/make_family_fixtures.py
"""

import copy
import datetime
import json
import os
import platform
import shutil

from absl import app
from absl import flags
import numpy as np
import tokenizers
import torch
import transformers

import transformers_reference  # scripts/transformers_reference.py

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OUT_DIR = flags.DEFINE_string("out_dir", "tests/testdata/families",
                               "Output directory (relative: to the repository root).")
_DATA_DIR = flags.DEFINE_string("data_dir", "../shared/data",
                                "Real-data directory (relative: to the repository root).")

BOOK = "books/pg1952_the_yellow_wallpaper_gilman.txt"
VOCAB = 384
NUM_GREEDY = 8
PROMPT_LENGTHS = (1, 17, 70, 200)  # one token, across a 16-block, across 64, most of a window

QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('only user and assistant roles') }}{%- endif %}"
    "{%- endfor %}")
LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
              max_position_embeddings=512, rms_norm_eps=1e-6)
# family -> (transformers config, special tokens, bos, eos, add_bos, chat template, shard bytes)
FAMILIES = {
    "llama": (lambda: transformers.LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
              ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
              "<|begin_of_text|>", "<|eot_id|>", True, LLAMA_TEMPLATE, None),
    "mistral": (lambda: transformers.MistralConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        tie_word_embeddings=False, rope_theta=1000000.0, sliding_window=256),
                ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", True, MISTRAL_TEMPLATE, None),
    "qwen2": (lambda: transformers.Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_theta=1000000.0, use_sliding_window=False),
              ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", False,
              QWEN_TEMPLATE, None),
    "qwen3": (lambda: transformers.Qwen3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=False, rope_theta=1000000.0, use_sliding_window=False),
              ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None,
              "<|im_end|>", False, QWEN3_TEMPLATE, 100_000),
}
CHATS = [
    ([{"role": "user", "content": "What is the wallpaper like?"}], True),
    ([{"role": "user", "content": "Who writes the journal?"},
      {"role": "assistant", "content": "The narrator does."},
      {"role": "user", "content": "Why does she hide it?"}], True),
]


def _resolve(path):
  return path if os.path.isabs(path) else os.path.normpath(os.path.join(_REPO_ROOT, path))


def _bpe(text, specials):
  """A byte-level BPE of VOCAB tokens trained on `text`, `specials` first."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=VOCAB, special_tokens=specials, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([text], trainer)
  return tok


@torch.no_grad()
def _randomize(model, seed):
  """Every parameter drawn at random (norm gains near 1), then rounded to bfloat16."""
  gen = torch.Generator().manual_seed(seed)
  for name, p in sorted(model.named_parameters()):
    if name.endswith("norm.weight"):
      value = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
    elif name.endswith(".bias"):
      value = 0.5 * torch.randn(p.shape, generator=gen)
    else:
      value = 0.15 * torch.randn(p.shape, generator=gen)
    p.copy_(value.to(torch.bfloat16).to(torch.float32))


def main(argv):
  del argv
  out_dir = _resolve(_OUT_DIR.value)
  with open(os.path.join(_resolve(_DATA_DIR.value), BOOK), encoding="utf-8") as f:
    text = f.read()[2000:40000]
  torch.set_num_threads(2)
  torch.use_deterministic_algorithms(True)
  os.makedirs(out_dir, exist_ok=True)
  meta = {
      "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                   "tokenizers": transformers_reference.version("tokenizers"),
                   "numpy": np.__version__, "python": platform.python_version()},
      "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "weights": "normal(0, 0.15), norm gains 1 + normal(0, 0.2), biases normal(0, 0.5), "
                 "rounded to bfloat16, saved as bfloat16; the reference runs them in float32",
      "last_logits": "model(input_ids=prompt, use_cache=False).logits[0, -1]",
      "greedy": "argmax at each step, each step one cache-free forward, no EOS stop; "
                "greedy_gap = logit(top1) - logit(top2)",
      "prompts": f"token ids drawn uniformly from [0, {VOCAB}) with numpy seed 1000 + family "
                 f"index, lengths {list(PROMPT_LENGTHS)}",
      "families": {},
  }
  for index, (family, (make_cfg, specials, bos, eos, add_bos, template,
                       shard_bytes)) in enumerate(FAMILIES.items()):
    torch.manual_seed(index)
    bpe = _bpe(text, specials)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=bos, eos_token=eos, add_bos_token=add_bos,
        chat_template=template)
    cfg = make_cfg()
    cfg.bos_token_id = None if bos is None else bpe.token_to_id(bos)
    cfg.eos_token_id = bpe.token_to_id(eos)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    _randomize(model, seed=index)
    folder = os.path.join(out_dir, family)
    shutil.rmtree(folder, ignore_errors=True)
    # A copy is cast for saving: casting the model itself would round its rotary inv_freq
    # buffer to bfloat16 too, and the reference would no longer be the float32 model.
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(
        folder, max_shard_size=shard_bytes or "50MB")
    tok.save_pretrained(folder)

    rng = np.random.default_rng(1000 + index)
    arrays = {"num_prompts": np.int32(len(PROMPT_LENGTHS))}
    for i, length in enumerate(PROMPT_LENGTHS):
      ids = rng.integers(0, VOCAB, size=length).tolist()
      logits = transformers_reference.last_logits(model, ids)
      greedy, gaps = transformers_reference.greedy(model, ids, NUM_GREEDY)
      arrays[f"prompt_ids_{i}"] = np.array(ids, np.int32)
      arrays[f"last_logits_{i}"] = logits
      arrays[f"greedy_ids_{i}"] = greedy
      arrays[f"greedy_gap_{i}"] = gaps
      print(f"{family}[{i}] len={length} logit_std={logits.std():.3f} "
            f"min_gap={gaps.min():.4f} greedy={greedy.tolist()}", flush=True)
    np.savez_compressed(os.path.join(out_dir, f"{family}_reference.npz"), **arrays)

    chats = []
    for messages, agp in CHATS:
      if family == "mistral" and messages[0]["role"] != "user":
        continue
      rendered = tok.apply_chat_template(messages, add_generation_prompt=agp, tokenize=False)
      chats.append({"messages": messages, "add_generation_prompt": agp, "text": rendered,
                    "ids": [int(i) for i in tok.encode(rendered, add_special_tokens=False)]})
    meta["families"][family] = {
        "architecture": cfg.architectures[0] if cfg.architectures else type(model).__name__,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "files": sorted(os.listdir(folder)),
        "bytes": sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)),
        "chat": chats,
    }
  with open(os.path.join(out_dir, "references.json"), "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1, ensure_ascii=False)
    f.write("\n")
  for family, info in meta["families"].items():
    print(f"{family}: {info['bytes']} bytes in {info['files']}")


if __name__ == "__main__":
  app.run(main)
