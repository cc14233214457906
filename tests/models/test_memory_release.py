"""Resident memory the loader gives back: library pages run once, and mapped source pages as they are copied.

Invariants read from /proc/self/smaps (never timings): which mappings release_library_pages() touches and
that what it drops reads back the same, that a written (copy-on-write) page is never dropped, and that a
bfloat16 load of a float32 checkpoint holds at most a chunk of the source's pages at a time.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from py_engine.models import load_model, loader  # noqa: E402
from py_engine.models.memory import library_mappings, release_library_pages  # noqa: E402
from tests.model_cases import FAMILIES, save_hf_model  # noqa: E402
from tests.requires import HARDWARE, kernels_missing  # noqa: E402

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="hardware: /proc/self/smaps and madvise are Linux's"),
              pytest.mark.usefixtures("torch_one_thread")]
PAGE = mmap.PAGESIZE


def mapping_rss(address: int) -> int:
    """Resident bytes of the mapping (VMA) that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and len(head[1]) == 4:
                lo, hi = (int(v, 16) for v in head[0].split("-"))
                inside = lo <= address < hi
            elif inside and head[0] == "Rss:":
                return int(head[1]) * 1024
    raise LookupError(f"no mapping holds {address:#x}")


def mapped(path: Path, read_only: bool = True) -> tuple[mmap.mmap, int]:
    """A private mapping of the file and its address, made read-only (mprotect) unless asked otherwise."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(m))
    if read_only:
        protect(address, len(m))
    return m, address


def protect(address: int, size: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(address, size, mmap.PROT_READ) == 0


def library_rss(name: str) -> int:
    """Resident bytes of the code (r-x) mappings of the file whose name contains `name`."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and len(head[1]) == 4:
                inside = len(head) >= 6 and head[1][2] == "x" and name in head[5].rsplit("/", 1)[-1]
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def test_library_pages_are_dropped_and_read_back_the_same():
    """libtorch_cpu's resident code pages go (no torch code runs between the release and the look); torch
    computes the same after, faulting back what it needs."""
    a, b = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)), torch.randn(64, 64)
    before = torch.nn.functional.silu(a @ b)  # some of libtorch_cpu is resident now, whatever ran earlier
    resident = library_rss("libtorch_cpu")
    assert resident > 64 << 10 and library_mappings()
    assert release_library_pages() > 0
    assert library_rss("libtorch_cpu") < min(resident, 1 << 20) / 4
    assert torch.equal(torch.nn.functional.silu(a @ b), before)


def test_written_and_writable_mappings_keep_their_bytes(tmp_path):
    """A page written through a private mapping (a relocation) lives only in memory: never dropped, even once
    the mapping is read-only; a clean read-only one is dropped and reads back the file's bytes."""
    lib = tmp_path / "libfake.so"
    lib.write_bytes(bytes(range(256)) * (4 * PAGE // 256))
    written, address = mapped(lib, read_only=False)
    written[:4] = b"RELO"
    protect(address, 4 * PAGE)  # as the dynamic loader does to relocated data (RELRO)
    clean, clean_address = mapped(lib)
    assert clean[PAGE + 7] == 7 and clean[3 * PAGE] == 0  # resident now
    assert mapping_rss(clean_address) >= 2 * PAGE
    listed = {start for start, _, _ in library_mappings()}
    assert clean_address in listed and address not in listed
    release_library_pages()
    assert mapping_rss(clean_address) == 0
    assert written[:4] == b"RELO" and written[4] == 4
    assert clean[:8] == bytes(range(8))
    written.close(), clean.close()


def test_other_files_are_never_touched(tmp_path):
    """A mapped checkpoint (not a shared object) keeps its pages: its tensors are the weights."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x01" * (4 * PAGE))
    m, address = mapped(weights)
    assert sum(m[i * PAGE] for i in range(4)) == 4
    release_library_pages()
    assert mapping_rss(address) == 4 * PAGE
    m.close()


def test_keep_library_pages_turns_it_off(monkeypatch):
    monkeypatch.setenv("RUVLLM_KEEP_LIBRARY_PAGES", "1")
    assert release_library_pages() == 0


def test_bfloat16_load_holds_a_chunk_of_the_source_at_a_time(tmp_path, monkeypatch):
    """Converting a mapped float32 tensor releases each block of rows once copied: the mapping never holds
    more than a chunk and the file's folios at its two ends (a read fault maps a page cache folio whole: up to
    2 MB), not the whole source; the result is tensor.to(bfloat16) bit for bit."""
    source = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(1))  # 16 MB
    save_file({"w": source}, tmp_path / "model.safetensors")
    checkpoint = loader.Checkpoint(tmp_path)
    tensor = checkpoint.get("w")  # mapped lazily: a page is resident once read
    held: list[int] = []
    release = checkpoint.release

    def watched(name: str, start: int = 0, stop: int | None = None) -> None:
        held.append(mapping_rss(tensor.data_ptr()))  # before: this chunk's pages are still mapped in
        release(name, start, stop)

    monkeypatch.setattr(checkpoint, "release", watched)
    chunk = 64 * 1024  # values: 64 rows, 256 KB
    out = loader._converted(checkpoint, "w", tensor, torch.bfloat16, torch.device("cpu"), chunk=chunk)
    assert len(held) == 4096 // 64 and max(held) <= 4 * chunk + (4 << 20) + 2 * PAGE, [h >> 10 for h in held]
    assert mapping_rss(tensor.data_ptr()) <= (2 << 20) + 2 * PAGE
    assert out.dtype == torch.bfloat16 and torch.equal(out, source.to(torch.bfloat16))


def test_bfloat16_load_equals_the_checkpoint_converted(tmp_path, monkeypatch):
    """load_model(dtype=bfloat16) in chunks of a few rows: every parameter is the file's tensor .to(bf16)."""
    save_hf_model(FAMILIES["llama3-rope"], tmp_path)
    monkeypatch.setattr(loader, "CONVERT_CHUNK", 1 << 12)  # several chunks per matrix
    model, _ = load_model(tmp_path, dtype="bfloat16")
    state = load_file(tmp_path / "model.safetensors")
    params = dict(model.named_parameters())
    assert params and all(p.dtype == torch.bfloat16 for p in params.values())
    for name, p in params.items():
        assert torch.equal(p, state[name].to(torch.bfloat16)), name


QWEN25_TOKENIZER = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "tokenizers" / "qwen2.5"
TOKENIZER_HEAP = """
import json, sys
sys.path.insert(0, sys.argv[1])
from py_engine.models.memory import rss_mb, trim_heap
from py_engine.tokenizer import Tokenizer
before = rss_mb()["anon"]
tokenizer = Tokenizer.from_pretrained(sys.argv[2])
loaded = rss_mb()["anon"]
trim_heap()
print(json.dumps({"loaded": loaded - before, "trimmed": rss_mb()["anon"] - before}))
"""


def test_trim_heap_gives_back_what_parsing_a_tokenizer_freed():
    """Qwen2.5's tokenizer.json (7 MB, 151k tokens and merges) leaves freed parse buffers in the heap: LLM and
    the server's engine call trim_heap() after loading it, and it hands ~11 MB of anonymous memory back."""
    import json
    import subprocess

    if not (QWEN25_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"shared fixture: {QWEN25_TOKENIZER} is missing")
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", TOKENIZER_HEAP, str(repo), str(QWEN25_TOKENIZER)],
                          capture_output=True, text=True, check=True, timeout=300)
    mib = json.loads(done.stdout.strip().splitlines()[-1])
    assert mib["loaded"] - mib["trimmed"] >= 4, mib


def test_llm_trims_the_heap_after_its_tokenizer(monkeypatch):
    from py_engine.backends import torch as backend

    order: list[str] = []
    load = backend.Tokenizer.from_pretrained
    monkeypatch.setattr(backend.Tokenizer, "from_pretrained",
                        staticmethod(lambda *a, **k: order.append("tokenizer") or load(*a, **k)))
    monkeypatch.setattr(backend, "trim_heap", lambda: order.append("trim"))
    backend.LLM("tiny-shakespeare", device="cpu", dtype="float32")
    assert order[-2:] == ["tokenizer", "trim"]


def test_a_quantized_table_holds_a_chunk_of_its_mapped_source_at_a_time(tmp_path, monkeypatch):
    """An LM head quantized from the mapped float32 checkpoint (transform.rtn_packed, as quantize_model does
    it) gives each block's source pages back once read: the mapping never holds more than RTN_CHUNK values
    (4 MiB) and the file's folios at its ends (blocks of 4M values held 16 MiB: the int8 0.5B model's quantize
    peak was its head's); the packed table equals the one-shot PackedWeight.pack(quantize_rtn(...))."""
    from py_engine.quant import transform
    from py_engine.quant.kernels import PackedWeight
    from py_engine.quant.mapped import MappedPages
    from py_engine.quant.rtn import quantize_rtn

    source = torch.randn(12288, 512, generator=torch.Generator().manual_seed(2))  # 24 MiB
    save_file({"w": source}, tmp_path / "model.safetensors")
    tensor = loader.Checkpoint(tmp_path).get("w")  # mapped lazily
    pages = MappedPages()
    held: list[int] = []
    release = pages.release
    monkeypatch.setattr(pages, "release", lambda t: held.append(mapping_rss(tensor.data_ptr())) or release(t))
    packed = transform.rtn_packed(tensor, 8, None, True, pages=pages)
    chunk_bytes = transform.RTN_CHUNK * 4
    assert len(held) >= 6 and max(held) <= chunk_bytes + (4 << 20) + 2 * PAGE, [h >> 10 for h in held]
    whole = PackedWeight.pack(quantize_rtn(source, 8, None, True))
    for name in ("codes", "scales", "zero_points"):
        assert torch.equal(getattr(packed, name), getattr(whole, name)), name
    assert packed.mins is None and whole.mins is None


MLP_PEAK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from py_engine.kernels import cpu_kernels
from py_engine.models.memory import rss_mb, trim_heap
from py_engine.quant.kernels import PackedWeight, QuantPlan
from py_engine.quant.rtn import quantize_rtn
kernels = cpu_kernels()
kernels.set_threads(2)
rows, hidden, inter = 512, 896, 4864  # a 512-token step of Qwen2.5-0.5B's MLP, int8 per channel
g = torch.Generator().manual_seed(0)
packed = lambda n, k: PackedWeight.pack(quantize_rtn(torch.randn(n, k, generator=g), 8, None, True), consume=True)
gate_up = QuantPlan(kernels, [packed(inter, hidden), packed(inter, hidden)], [None, None])
down = QuantPlan(kernels, [packed(hidden, inter)], [None])
x = torch.randn(rows, hidden, generator=g)
trim_heap()  # what quantizing freed goes back: the step's buffers are new pages
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = rss_mb()
down(gate_up(x, gated=True))
print(json.dumps({"panels": kernels.int8_rows_for(8) > rows, "before": before["rss"], "peak": rss_mb()["peak"]}))
"""


def test_a_prefill_mlp_on_the_panels_holds_its_output_not_the_whole_product():
    """One 512-row int8 MLP step (gate/up, SiLU, down) in a fresh process: on the panels (AVX-512 VNNI) its
    peak over the RSS before is the gated output (9.5 MiB) and the down projection's (1.75 MiB) plus the
    kernels' scratch (int8 x, panel buffers, a 1.25 MiB block of the product): ~16 MiB, bound at 19; the
    [512, 9728] product (19 MiB) beside the output and an fp32 copy of x for sgemm that the panels never read
    (9.5 MiB, kept) made it ~35 MiB."""
    import json
    import subprocess

    from py_engine.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip(str(kernels_missing()))
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", MLP_PEAK, str(repo)], capture_output=True, text=True, check=True,
                          timeout=300)
    mib = json.loads(done.stdout.strip().splitlines()[-1])
    if not mib["panels"]:
        pytest.skip(f"{HARDWARE}no AVX-512 VNNI: prefill runs MKL's sgemm on fp32 x, the product whole")
    outputs = 512 * (4864 + 896) * 4 / 2**20
    assert mib["peak"] - mib["before"] <= outputs + 8, mib
