"""scripts/compile_check.py's CUDA lowering of every program `LLM()` builds, at tiny shapes: the
step, inserts, reads, every codec's insert and encoder (kvtc included), the layer-wise programs
and the store client's rANS decode, each lowered for CUDA on this CPU host (no GPU needed).
A program that does not lower fails here before a device session finds it."""

import pathlib
import sys

from absl.testing import absltest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "scripts"))
import compile_check as cc  # noqa: E402  pylint: disable=wrong-import-position

from kvjax.models.nn import config as model_configs  # noqa: E402
from kvjax.models.runner.runner_api import PagedRunnerConfig  # noqa: E402

C = 64


class CudaLoweringTest(absltest.TestCase):

  def test_every_llm_program_lowers_for_cuda(self):
    # Head dim 16: the Triton attention kernel's smallest (the default tiny model's 8 is refused,
    # a ValueError naming the head dim, so LLM("tiny") cannot run on a GPU).
    cfg = model_configs.tiny(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16)
    rc = PagedRunnerConfig(num_blocks=32, block_size=16, max_num_seqs=2,
                           max_num_batched_tokens=64, chunk_sizes=(C,))
    progs = cc.cuda_programs(cfg, cc.abstract_model(cfg), rc, chunk=C, buckets=(8,),
                             codecs=("raw", "int8", "int4", "cachegen", "kvtc"), groups=2)
    self.assertEqual([name for name, _, _ in progs], [
        "step[T=8]", f"insert_raw[C={C}]", f"read_pre_rope[C={C}]",
        f"insert_payload[raw,C={C}]", f"encode[raw,levels=1,C={C}]",
        f"insert_payload[int8,C={C}]", f"encode[int8,levels=1,C={C}]",
        f"insert_payload[int4,C={C}]", f"encode[int4,levels=1,C={C}]",
        f"insert_payload[cachegen,C={C}]", f"encode[cachegen,levels=4,C={C}]",
        f"insert_payload[kvtc,C={C}]", f"encode[kvtc,levels=5,C={C}]",
        "layers_begin[T=8]", "layers[G=1,T=8]", "layers_finish[T=8]",
        f"insert_layers[G=1,n=8,C={C}]", f"rans_decode[kvtc codes 2x2x{C}x32]",
        f"kvtc_decode[C={C}]"])
    rows = {name: cc.lower_cuda(name, fn, args) for name, fn, args in progs}
    failed = {name: r["error"] for name, r in rows.items() if not r["ok"]}
    self.assertEqual(failed, {})
    # The Pallas kernels went to Triton (not Mosaic GPU): attention in the step and each group,
    # the codec kernels in the inserts and encoders, the rANS decoder.
    for name in ("step[T=8]", "layers[G=1,T=8]", f"insert_payload[int4,C={C}]",
                 f"encode[int8,levels=1,C={C}]", f"rans_decode[kvtc codes 2x2x{C}x32]"):
      self.assertGreaterEqual(rows[name]["triton_calls"], 1, name)
      self.assertEqual(rows[name]["mosaic_gpu_calls"], 0, name)

  def test_a_program_that_does_not_lower_is_a_failed_row(self):
    cfg = model_configs.tiny()  # head dim 8: the Triton attention kernel refuses it
    rc = PagedRunnerConfig(num_blocks=32, block_size=16, max_num_seqs=2,
                           max_num_batched_tokens=64, chunk_sizes=(C,))
    (name, fn, args), = cc.selected(
        cc.cuda_programs(cfg, cc.abstract_model(cfg), rc, chunk=C, buckets=(8,), codecs=(),
                         groups=None, extras=False), ["step"])
    row = cc.lower_cuda(name, fn, args)
    self.assertFalse(row["ok"])
    self.assertIn("head dim 8", row["error"])


if __name__ == "__main__":
  absltest.main()
