"""Float weights copied into 2 MiB pages at load (py_engine/models/hugepages.py): same values, advised
mappings, source pages released as the copy goes, and a model that decodes as transformers does."""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from py_engine.models import load_model  # noqa: E402
from py_engine.models.hugepages import HUGE_PAGE, huge_page_copy, huge_page_empty  # noqa: E402
from py_engine.models.safetensors_io import SafetensorsFile  # noqa: E402
from tests.model_cases import TINY, decode_logits, prompt, save_hf_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

# gate/up/down of 4608 x 256 are 4.5 MiB in fp32, 2.25 MiB in bf16: whole huge pages and a tail each
WIDE = {**TINY, "model_type": "llama", "hidden_size": 256, "intermediate_size": 4608, "tie_word_embeddings": True}


def vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds address (Linux /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_has_the_values_and_asks_for_huge_pages(dtype, monkeypatch):
    monkeypatch.setattr("py_engine.models.hugepages.CHUNK_BYTES", 1 << 20)  # several chunks
    src = torch.randn(1500, 700)  # 4.0 MiB of fp32: two huge pages' worth and a tail
    released = []
    out = huge_page_copy(src, dtype, lambda first, stop: released.append((first, stop)))
    assert out is not None and out.dtype == dtype and out.shape == src.shape
    assert torch.equal(out, src.to(dtype))
    assert out.data_ptr() % HUGE_PAGE == 0
    assert "hg" in vm_flags(out.data_ptr())  # MADV_HUGEPAGE on the whole huge pages
    nbytes = out.numel() * out.element_size()
    assert "nh" in vm_flags(out.data_ptr() + nbytes - 1)  # the tail in small pages (a split mapping)
    row = 700 * 4  # release counts the source's bytes, in order, every byte once
    assert released[0][0] == 0 and released[-1][1] == 1500 * row and len(released) > 1
    assert all(a[1] == b[0] for a, b in zip(released, released[1:]))


def test_small_tensors_and_the_switch_give_none(monkeypatch):
    assert huge_page_empty((HUGE_PAGE // 4 - 1,), torch.float32) is None  # under one huge page: left alone
    assert huge_page_empty((HUGE_PAGE // 4,), torch.float32) is not None
    monkeypatch.setenv("RUVLLM_HUGE_PAGES", "0")
    assert huge_page_copy(torch.randn(1024, 1024), torch.float32) is None


def test_safetensors_release_of_a_byte_range(tmp_path):
    """release(name, first, stop) drops only whole pages inside the range; the tensor still reads back."""
    from safetensors.torch import save_file

    weights = torch.randn(64, 4096)
    save_file({"w": weights}, tmp_path / "m.safetensors")
    f = SafetensorsFile(tmp_path / "m.safetensors")
    view = f.get("w")
    assert torch.equal(view, weights)  # every page mapped in
    f.release("w", 4096 * 4 * 8, 4096 * 4 * 40)
    assert torch.equal(f.get("w"), weights)  # dropped pages map in again from the file


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("wide")
    return folder, save_hf_model(WIDE, folder)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_in_huge_pages_decodes_as_transformers_does(wide, dtype):
    """Prefill + token-at-a-time decode on the CPU kernels (the one-call step), weights in 2 MiB pages:
    the same logits as the same model in small pages, and transformers' within the dtype's rounding."""
    from py_engine.cpu.transforms import optimize_for_cpu

    folder, hf = wide
    ids = prompt(12)
    got = {}
    for pages in (True, False):
        model, _ = load_model(folder, dtype=dtype, huge_pages=pages)
        gate = model.model.layers[0].mlp.gate_proj.weight
        assert (gate.data_ptr() % HUGE_PAGE == 0) == pages
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
        optimize_for_cpu(model)
        with torch.no_grad():
            got[pages] = decode_logits(model, ids, 4).float()
    assert torch.equal(got[True], got[False])
    with torch.no_grad():
        reference = hf(ids).logits
    tolerance = 1e-4 if dtype == "float32" else 0.1 * reference.abs().max().item()
    assert (got[True] - reference).abs().max().item() < tolerance


def test_an_arena_hands_out_aligned_copies_until_full(monkeypatch):
    from py_engine.models.hugepages import HugeArena, no_arenas

    arena = HugeArena(3 << 20)
    a, b = torch.randn(1000, 3), torch.arange(50, dtype=torch.int32)
    ca, cb = arena.take(a), arena.take(b)
    assert torch.equal(ca, a) and torch.equal(cb, b)
    assert ca.data_ptr() % HUGE_PAGE == 0 and cb.data_ptr() == ca.data_ptr() + 12032  # 12000 bytes, to 64
    assert "hg" in vm_flags(ca.data_ptr())
    big = torch.zeros(3 << 20, dtype=torch.uint8)
    assert arena.take(big) is big  # no room left: the tensor as it was
    assert arena.take(None) is None
    monkeypatch.setenv("RUVLLM_HUGE_PAGES", "0")
    assert HugeArena(1 << 20).empty((4,), torch.float32) is None
    monkeypatch.delenv("RUVLLM_HUGE_PAGES")
    with no_arenas():
        assert HugeArena(1 << 20).take(a) is a
    assert HugeArena(1 << 20).take(a) is not a
