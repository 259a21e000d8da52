"""bench/ncu_stalls.py: the SASS mnemonic parser and the per-reason / per-class sums, on a tiny
source page in Nsight Compute's CSV layout and on a committed profile."""

import gzip
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def stalls(bench_script):
    return bench_script("ncu_stalls")


def test_opcode_drops_predicates_and_modifiers(stalls):
    assert stalls.opcode("      @!P0 IMAD.MOV.U32 R1, RZ, RZ, R2") == "IMAD"
    assert stalls.opcode("@UPT PRMT R48, R52, 0x4140, RZ") == "PRMT"
    assert stalls.opcode("HMMA.16816.F32 R48, R48, R56, RZ") == "HMMA"
    assert stalls.opcode("  ") == ""


def test_summary_sums_all_sample_reasons_only(stalls, tmp_path):
    head = '"Address","Source","stall_long_sb","stall_short_sb","stall_long_sb (Not Issued)"'
    rows = ['"0x10","  BAR.SYNC.DEFER_BLOCKING 0x0","30","0","99"',
            '"0x20","  @!P1 PRMT R4, R5, 0x4140, RZ","0","10","99"',
            '"0x30","  LOP3.LUT R1, R2, 0xf, RZ, 0xc0, !PT","0","20","99"']
    path = tmp_path / "page.csv.gz"
    with gzip.open(path, "wt") as fh:
        fh.write('"Kernel Name","_decode_kernel",\n' + head + "\n" + "\n".join(rows) + "\n")
    s = stalls.summarize(str(path))
    assert s["samples"] == 60
    assert s["reasons"] == {"long_sb": 30, "short_sb": 30}
    conv = s["classes"]["code conversion (byte permute / mask / shift)"]
    assert conv["samples"] == 30 and conv["short_sb"] == 30
    assert s["classes"]["barrier"]["long_sb"] == 30
    text = "\n".join(stalls.markdown(str(path), s))
    assert "| long_sb | 50.0% |" in text


def test_committed_decode_profile_is_read(stalls):
    path = Path(__file__).resolve().parent.parent / "results" / "gpu" / "ncu_decode_sass_d128_K8V4.csv.gz"
    s = stalls.summarize(str(path))
    assert s["samples"] > 1000
    assert abs(sum(c["samples"] for c in s["classes"].values()) - s["samples"]) < 1e-6


def test_a_file_without_a_source_page_is_an_error(stalls, tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Kernel Name"\n"0","_decode_kernel"\n')
    with pytest.raises(ValueError, match="no SASS source page"):
        stalls.summarize(str(path))
