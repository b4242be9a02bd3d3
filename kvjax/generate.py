"""Generate with the real model from the command line (the README's main job until the server).

    python -m kvjax.generate                                  # the embedded default chat prompt
    python -m kvjax.generate --prompt "Tell me about JAX" --max_tokens 64
    python -m kvjax.generate --prompt_file=book.txt
        --max_prompt_tokens=2000 --question="Who is the narrator?"

Thin entry point: absl flags -> `LLM` -> print the text, TTFT and token accounting.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging

from kvjax import LLM, SamplingParams

DEFAULT_PROMPT = "In three sentences, explain why prefix caching speeds up long prompts."

_MODEL = flags.DEFINE_string("model", "SmolLM2-135M-Instruct",
                             "Model name, .gguf path, or Hugging Face safetensors directory.")
_PROMPT = flags.DEFINE_string("prompt", DEFAULT_PROMPT, "User message (chat template applied).")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None,
                                   "Read a document from this file and ask --question about it.")
_QUESTION = flags.DEFINE_string("question", "Summarize the text above in two sentences.",
                                "Question asked after --prompt_file's document.")
_MAX_PROMPT_TOKENS = flags.DEFINE_integer("max_prompt_tokens", 3000,
                                          "Keep the document's first N tokens.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 48, "Output tokens at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 is greedy.")
_SEED = flags.DEFINE_integer("seed", None, "Sampling seed (with --temperature > 0).")
_DTYPE = flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"], "Compute dtype.")


def _check_flags() -> SamplingParams:
  """Rejects bad flags before the model loads; returns the sampling parameters."""
  if _PROMPT_FILE.value is None and not _PROMPT.value.strip():
    raise app.UsageError("--prompt is empty: give a message to send")
  if _PROMPT_FILE.value is None and flags.FLAGS["question"].present:
    raise app.UsageError("--question needs --prompt_file (the document it asks about)")
  if _PROMPT_FILE.value is not None and not os.path.isfile(_PROMPT_FILE.value):
    raise app.UsageError(f"--prompt_file={_PROMPT_FILE.value}: no such file")
  if _MAX_PROMPT_TOKENS.value <= 0:
    raise app.UsageError(f"--max_prompt_tokens={_MAX_PROMPT_TOKENS.value} must be positive")
  try:
    return SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=_TEMPERATURE.value,
                          seed=_SEED.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; pass text with --prompt")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save and restore at INFO
  params = _check_flags()
  try:
    _generate(params)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def _generate(params: SamplingParams) -> None:
  t0 = time.perf_counter()
  llm = LLM(_MODEL.value, dtype=_DTYPE.value, max_num_seqs=1)
  print(f"loaded {llm.model_name} in {time.perf_counter() - t0:.1f} s "
        f"(fingerprint {llm.fingerprint[:12]})")
  content = _PROMPT.value
  if _PROMPT_FILE.value:
    tok = llm.get_tokenizer()
    with open(_PROMPT_FILE.value, encoding="utf-8") as f:
      doc_ids = tok.encode(f.read(), add_special_tokens=False)[:_MAX_PROMPT_TOKENS.value]
    content = tok.decode(doc_ids) + "\n\n" + _QUESTION.value
  t0 = time.perf_counter()
  out = llm.chat([{"role": "user", "content": content}], params)[0]
  total_s = time.perf_counter() - t0
  print(out.text)
  m = out.metrics
  decode_s = max(total_s - m.ttft_s, 1e-9)
  print(f"\nprompt {len(out.prompt_token_ids)} tokens (computed {m.num_computed_tokens}, loaded "
        f"{m.num_loaded_tokens}) | TTFT {m.ttft_s:.2f} s | {len(out.token_ids)} output tokens, "
        f"{(len(out.token_ids) - 1) / decode_s:.1f} tokens/s after the first | "
        f"finish_reason={out.finish_reason}")


if __name__ == "__main__":
  app.run(main)
