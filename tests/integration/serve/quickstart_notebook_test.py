"""notebooks/quickstart.ipynb runs top to bottom on CPU with the tiny model.

The code cells are executed in order in one namespace (shell lines such as `!pip install` are
skipped), from the notebook's folder, with matplotlib's non-interactive backend; the book comes
from ../shared/data when present, else a stand-in text.
"""

import json
import os
import pathlib

import pytest
from absl.testing import absltest

REPO = pathlib.Path(__file__).resolve().parents[3]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"


def code_of(notebook: pathlib.Path) -> str:
  cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
  lines = []
  for cell in cells:
    if cell["cell_type"] == "code":
      lines += [line for line in "".join(cell["source"]).splitlines()
                if not line.lstrip().startswith(("!", "%"))]
  return "\n".join(lines)


@pytest.mark.slow
class QuickstartNotebookTest(absltest.TestCase):

  def test_runs_on_cpu_with_the_tiny_model(self):
    book = REPO.parent / "shared" / "data" / "books" / "pg1952_the_yellow_wallpaper_gilman.txt"
    if not book.is_file():
      book = pathlib.Path(self.create_tempfile(content="It is very seldom that mere ordinary "
                                               "people secure ancestral halls. " * 20).full_path)
    env = {"KVJAX_QUICKSTART_MODEL": "tiny", "KVJAX_QUICKSTART_CHARS": "400",
           "KVJAX_QUICKSTART_CHUNK": "32", "KVJAX_QUICKSTART_BOOK": str(book),
           "MPLBACKEND": "Agg"}
    old_env = {k: os.environ.get(k) for k in env}
    old_cwd = os.getcwd()
    os.environ.update(env)
    os.chdir(NOTEBOOK.parent)
    try:
      scope: dict = {"__name__": "__main__"}
      exec(compile(code_of(NOTEBOOK), str(NOTEBOOK), "exec"), scope)  # noqa: S102
    finally:
      os.chdir(old_cwd)
      for k, v in old_env.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
    cold, warm, resp = scope["cold"], scope["warm"], scope["resp"]
    self.assertEqual(cold.metrics.num_loaded_tokens, 0)
    self.assertGreater(warm.metrics.num_loaded_tokens, 0)
    self.assertEqual(warm.text, cold.text)
    self.assertEqual(resp.choices[0].message.content, cold.text)
    # Cake puts the meeting point where timing does: some prefix chunks load, never the last token.
    chunk, n = 32, len(warm.prompt_token_ids)
    cached = resp.usage.prompt_tokens_details.cached_tokens
    self.assertEqual(cached % chunk, 0)
    self.assertLessEqual(cached, chunk * ((n - 1) // chunk))
    self.assertEqual(set(scope["ttft"]), {"compute only", "load only", "cake"})
    traces = scope["traces"]
    self.assertEqual(traces["compute_only"].chunks_loaded, [])
    self.assertEqual(len(traces["load_only"].chunks_loaded), (n - 1) // chunk)


if __name__ == "__main__":
  absltest.main()
