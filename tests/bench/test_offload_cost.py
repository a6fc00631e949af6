"""The no-reuse offload A/B runs both variants in alternating order and reports their ratios."""

from __future__ import annotations

from asyncpp.bench.offload_cost import main
from asyncpp.bench.runs import to_toml
from tests.runtime.harness import tiny_sections


def test_offload_cost_alternates_both_variants_and_reports_ratios(capsys, tmp_path, tiny_hf_dir):
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(tiny_sections(tiny_hf_dir, 2, (2, 2), kv_transfer={"store_size_mb": 1})))
    argv = ["--config", str(config), "--rounds", "2", "--num-prompts", "3", "--input-words", "8", "--output-len", "4"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    order = [line.split()[2] for line in lines if line.startswith("round")]
    assert order == ["none", "offload", "offload", "none"]
    assert any(line.startswith("offload / none CPU per token:") for line in lines)
    assert any(line.startswith("offload / none output tok/s:") for line in lines)
