"""The paged-attention kernel compiled for an H100 (sm_90) on any machine, with the ptxas that ships
with Triton: what the interpreter cannot check (that it compiles for the GPU, spills no registers,
and what its loops execute). scripts/sass_stats.py compiles, in a process of its own (the tests'
kernels are the interpreter's)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "sass_stats.py"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="Triton ships no ptxas here")
SPECS = ["prefill,group=2", "prefill,group=4,fp8=1", "decode,group=2", "decode,group=2,splits=2", "decode,group=4,fp8=1"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("sass") / "stats.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, str(SCRIPT), "--json", str(out), *SPECS], env=env, check=True,
                   capture_output=True, timeout=300)
    return {row["variant"]: row for row in json.loads(out.read_text())}


@pytest.mark.parametrize("spec", SPECS)
def test_paged_attention_compiles_for_hopper_without_spilling(compiled, spec):
    row = compiled[spec]
    assert row["stack"] == 0, row
    assert row["programs_per_sm"] >= 2, row


def test_prefill_key_tiles_below_the_diagonal_compare_no_positions(compiled):
    """A prompt's query tile reads most of its keys in tiles every row sees in full: that loop
    selects nothing per score (no FSEL) and is shorter than the loop over the diagonal's tiles."""
    unmasked, diagonal = compiled["prefill,group=2"]["loops"]
    assert "FSEL" not in unmasked and diagonal.get("FSEL", 0) > 0, compiled["prefill,group=2"]
    assert unmasked["HGMMA"] > 0 and unmasked["instructions"] < diagonal["instructions"]
