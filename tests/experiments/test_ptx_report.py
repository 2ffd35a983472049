"""experiments/ptx_report.py on a hand-written PTX module (two kernels, predicated and
vector statements, declarations that are not instructions)."""

import gzip
import json

import pytest

from experiments import ptx_report

PTX = """
.version 8.4
.target sm_90a
.visible .entry decode_attention_scores_nvfp4(
  .param .u64 p0
)
{
  .reg .b32 %r<9>;
  .shared .align 16 .b8 global_smem[8192];
  ld.global.v2.b32 {%r1, %r2}, [%rd1];
  prmt.b32 %r3, %r1, %r2, %r4;
  @%p1 st.shared.v4.b32 [%r5], {%r1, %r2, %r3, %r4};
  bar.sync 0;
  ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r6];
  mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1,%f2}, {%r1,%r2}, {%r5}, {%f1,%f2};
$L__BB0_2:
  // a comment;
  ret;
}
.visible .entry other_kernel()
{
  wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 1, 1;
  ret;
}
"""


def test_counts_each_kernel_apart(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "module.ptx").write_text(PTX)
  found = ptx_report.report(str(tmp_path), "decode_attention")
  assert list(found) == ["decode_attention_scores_nvfp4"]
  c = found["decode_attention_scores_nvfp4"]
  assert (c["ld_global"], c["prmt"], c["st_shared"], c["bar"], c["ldmatrix"], c["mma_sync"],
          c["wgmma"]) == (1, 1, 1, 1, 1, 1, 0)
  assert c["total"] == 7 and c["shared_bytes"] == 8192  # ret counts; labels, comments do not
  assert ptx_report.report(str(tmp_path), "other")["other_kernel"]["wgmma"] == 1


def test_main_fails_loudly_without_a_match(tmp_path):
  (tmp_path / "m.ptx").write_text(PTX)
  with pytest.raises(SystemExit, match="no kernel matching"):
    ptx_report.main(["prog", f"--dump_dir={tmp_path}", "--kernels=nothing_here"])
  with pytest.raises(FileNotFoundError):
    ptx_report.report(str(tmp_path / "missing"), "x")


def test_main_writes_counts_and_bodies(tmp_path):
  (tmp_path / "m.ptx").write_text(PTX)
  out, bodies = tmp_path / "c.json", tmp_path / "b.ptx.gz"
  found = ptx_report.main(["prog", f"--dump_dir={tmp_path}", f"--json_out={out}",
                           f"--bodies_out={bodies}"])
  assert json.loads(out.read_text()) == found
  text = gzip.open(bodies, "rt").read()
  assert "decode_attention_scores_nvfp4" in text and "other_kernel" not in text
