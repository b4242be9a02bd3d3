"""notebooks/quickstart.ipynb runs top to bottom on CPU with the tiny model, executed the way
users run it: nbclient drives a Jupyter kernel (ipykernel, the Python running this test) over
every cell in order, `%pip` cells included, from the notebook's folder.

Its install cells install only what the kernel lacks, and the test's Python has kvjax, matplotlib
and openai, so they install nothing and reach no network; the story is the one shipped in kvjax
(the default path); matplotlib draws with its non-interactive backend. One cell appended to the
notebook in memory reports the values the assertions read, as JSON.
"""

import json
import os
import pathlib

import pytest
from absl.testing import absltest

REPO = pathlib.Path(__file__).resolve().parents[3]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
CHUNK = 32
ENV = {"KVJAX_QUICKSTART_MODEL": "tiny", "KVJAX_QUICKSTART_CHARS": "400",
       "KVJAX_QUICKSTART_CHUNK": str(CHUNK), "MPLBACKEND": "Agg",
       # The warm request loads every stored chunk whatever the machine's speed (under Cake the
       # tiny model's compute may win them all: CI computed the whole prompt once, loading 0).
       "KVJAX_QUICKSTART_MERGE": "load_only",
       # The kernel imports this checkout's kvjax, whatever the environment has installed.
       "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}

REPORT = """
import json
print("REPORT " + json.dumps({
    "cold": [cold.text, cold.metrics.num_loaded_tokens, len(cold.prompt_token_ids)],
    "warm": [warm.text, warm.metrics.num_loaded_tokens, warm.metrics.num_device_cached_tokens,
             warm.metrics.num_computed_tokens],
    "dropped": dropped, "document": document[:60], "book": BOOK, "model": MODEL,
    "accelerator": JAX_EXTRA,
    "served": [resp.choices[0].message.content, resp.usage.prompt_tokens_details.cached_tokens],
    "ttft": sorted(ttft), "compute_only_loaded": traces["compute_only"].chunks_loaded,
    "load_only_loaded": traces["load_only"].chunks_loaded,
    "turn1": [list(turn1.prompt_token_ids), list(turn1.token_ids)],
    "turn2": [list(turn2.prompt_token_ids), turn2.num_cached_tokens],
}))
"""


def run_notebook(path: pathlib.Path, extra_source: str) -> list[dict]:
  """Executes `path`'s cells and then `extra_source` in a fresh kernel; returns the cells with
  their outputs. Raises nbclient's CellExecutionError on a failing cell."""
  import nbclient  # noqa: PLC0415 - the slow suite's dependency only
  import nbformat  # noqa: PLC0415
  nb = nbformat.read(path, as_version=4)
  nb.cells.append(nbformat.v4.new_code_cell(extra_source))
  client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                   resources={"metadata": {"path": str(path.parent)}})
  client.execute()
  return nb.cells


@pytest.mark.slow
class QuickstartNotebookTest(absltest.TestCase):

  def test_runs_on_cpu_with_the_tiny_model(self):
    old_env = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)  # the kernel inherits this process's environment
    try:
      cells = run_notebook(NOTEBOOK, REPORT)
    finally:
      for k, v in old_env.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
    lines = [line for out in cells[-1].outputs if out.get("name") == "stdout"
             for line in out["text"].splitlines() if line.startswith("REPORT ")]
    self.assertLen(lines, 1, cells[-1].outputs)
    r = json.loads(lines[0][len("REPORT "):])
    # The default path: the story shipped in kvjax, nothing to install, no accelerator here.
    self.assertIsNone(r["book"])
    story = (REPO / "kvjax" / "data" / "calibration_prose.txt").read_text(encoding="utf-8")
    self.assertEqual(r["document"], story[:60])
    self.assertEqual(r["model"], "tiny")
    self.assertIsNone(r["accelerator"])
    # Cold computes everything; warm, with the device copy dropped, loads from the store.
    cold_text, cold_loaded, n = r["cold"]
    warm_text, warm_loaded, warm_device, warm_computed = r["warm"]
    self.assertEqual(cold_loaded, 0)
    self.assertGreater(r["dropped"], 0)
    self.assertEqual(warm_device, 0)
    self.assertGreater(warm_loaded, 0)
    self.assertEqual(warm_loaded + warm_computed, n)
    self.assertEqual(warm_text, cold_text)
    # The server answers the same question the same way, from the cache.
    served_text, served_cached = r["served"]
    self.assertEqual(served_text, cold_text)
    self.assertGreater(served_cached, 0)
    self.assertLessEqual(served_cached, n - 1)
    # Cake's three modes; compute-only loads nothing, load-only every whole chunk before the
    # last token.
    self.assertEqual(r["ttft"], ["cake", "compute only", "load only"])
    self.assertEqual(r["compute_only_loaded"], [])
    self.assertLen(r["load_only_loaded"], (n - 1) // CHUNK)
    # The session's turn 2 extends turn 1's exact ids and hits on every one whose KV exists
    # (all but turn 1's last sampled token, never fed to the model).
    (prompt1, reply1), (prompt2, cached2) = r["turn1"], r["turn2"]
    self.assertEqual(prompt2[:len(prompt1) + len(reply1)], prompt1 + reply1)
    self.assertGreaterEqual(cached2, len(prompt1) + len(reply1) - 1)


if __name__ == "__main__":
  absltest.main()
