"""Probes of the CUDA behaviour the fast paths depend on, measured on the GPU they run on: one section per run, one
JSON object per finding appended to `--out` as soon as it is measured (a killed run keeps what it wrote).

Sections (each in its own process in `tools/gpu_check.sh`, so that a poisoned CUDA context cannot spoil the next):

- `bandwidth`: host-to-device and device-to-host copies from pageable, page-locked (`pin_memory()`) and registered
  in place (`cudaHostRegister`) memory; `module.to()` both ways; how long a non-blocking copy from pageable memory
  holds the host.
- `pagelock`: what a refused `cudaHostRegister` through `torch.cuda.cudart()` leaves behind (is the next kernel
  poisoned?), memory already page-locked, a range registered twice, clearing the error, the driver API instead;
  neighbouring ranges of one mapping that share a page (as they lie, page-rounded, the whole mapping at once).
- `mapped`: registering tensors loaded from a safetensors file (slices of a file mapping), and copy speed from them.
- `pools`: whether memory freed on a side stream is reused by the compute stream (per-stream pools).
- `fingerprint`: change detection's fingerprint against one plain read of the same bytes, on the GPU and the CPU.
- `tiny`: the tiny FLUX pipeline, saved and reloaded from safetensors, under each fast-path option on the GPU,
  images against no offload, under `torch.no_grad()` and `torch.inference_mode()`.

    python benchmarks/gpu_probes.py bandwidth --out results.jsonl
"""

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
import traceback

import torch

GIB = 1 << 30
OUT = None


def emit(section: str, name: str, value=None, **values) -> None:
    """One finding (`value`, when it has one, and named values), printed and appended to the results file at once."""
    record = {"section": section, "name": name, **({} if value is None else {"value": value}), **values}
    line = json.dumps(record, default=str)
    print(line, flush=True)
    if OUT:
        with open(OUT, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def sync():
    torch.cuda.synchronize()


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


def timed(fn, repeat: int = 3):
    """The best of `repeat` wall-clock times of `fn()` with the device synchronised around it."""
    best = None
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        elapsed = time.perf_counter() - start
        best = elapsed if best is None else min(best, elapsed)
    return best


def kernel_ok():
    """Runs a small kernel and synchronises: `None` if fine, else the error's first line."""
    try:
        x = torch.arange(1024, device="cuda", dtype=torch.float32)
        (x * 2).sum().item()
        sync()
        return None
    except Exception as error:  # the point of the probe
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def code(result) -> int:
    return int(getattr(result, "value", result))


def loaded_library(fragment: str):
    """Path of the shared library already loaded in this process whose name contains `fragment`."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            path = line.split()[-1]
            if fragment in os.path.basename(path) and path.startswith("/"):
                return path
    return None


def section_bandwidth():
    n = 2 * GIB
    host = torch.ones(n, dtype=torch.uint8)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    emit("bandwidth", "h2d pageable .copy_", gbps(n, timed(lambda: dev.copy_(host))), unit="GB/s", bytes=n)
    emit("bandwidth", "h2d pageable .to(cuda) (new allocation)", gbps(n, timed(lambda: host.to("cuda"))), unit="GB/s")
    # How long the host is held by a non-blocking copy from pageable memory.
    sync()
    start = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    issued = time.perf_counter() - start
    sync()
    total = time.perf_counter() - start
    emit("bandwidth", "h2d pageable non_blocking: host held", issued_s=round(issued, 4), total_s=round(total, 4),
         host_held_share=round(issued / total, 3))  # fmt: skip
    pinned = host.pin_memory()
    emit("bandwidth", "h2d pin_memory() non_blocking",
         gbps(n, timed(lambda: dev.copy_(pinned, non_blocking=True))), unit="GB/s")  # fmt: skip
    sync()
    start = time.perf_counter()
    dev.copy_(pinned, non_blocking=True)
    issued = time.perf_counter() - start
    sync()
    emit("bandwidth", "h2d pinned non_blocking: host held", issued_s=round(issued, 5),
         total_s=round(time.perf_counter() - start, 4))  # fmt: skip
    back = torch.empty(n, dtype=torch.uint8).pin_memory()
    emit("bandwidth", "d2h into pinned non_blocking",
         gbps(n, timed(lambda: back.copy_(dev, non_blocking=True))), unit="GB/s")  # fmt: skip
    emit("bandwidth", "d2h .to(cpu) (new pageable allocation)", gbps(n, timed(lambda: dev.to("cpu"))), unit="GB/s")
    paged = torch.empty(n, dtype=torch.uint8)
    paged.fill_(1)
    emit("bandwidth", "d2h into touched pageable .copy_", gbps(n, timed(lambda: paged.copy_(dev))), unit="GB/s")
    del pinned, back
    runtime = torch.cuda.cudart()
    start = time.perf_counter()
    rc = code(runtime.cudaHostRegister(host.data_ptr(), n, 0))
    reg_s = time.perf_counter() - start
    emit("bandwidth", "cudaHostRegister in place", code=rc, seconds=round(reg_s, 4), gb_per_s=gbps(n, reg_s))
    if rc == 0:
        emit("bandwidth", "h2d registered in place non_blocking",
             gbps(n, timed(lambda: dev.copy_(host, non_blocking=True))), unit="GB/s")  # fmt: skip
        start = time.perf_counter()
        rc = code(runtime.cudaHostUnregister(host.data_ptr()))
        emit("bandwidth", "cudaHostUnregister", code=rc, seconds=round(time.perf_counter() - start, 4))
    # A module of 2 GiB in bf16 in 256 tensors, like a stack of transformer blocks.
    module = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(256)]).to(torch.bfloat16)
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())

    def there_and_back(target):
        module.to(target)

    emit("bandwidth", "module.to(cuda) from pageable", gbps(nbytes, timed(lambda: there_and_back("cuda"), 1)),
         unit="GB/s", bytes=nbytes, tensors=256)  # fmt: skip
    emit("bandwidth", "module.to(cpu)", gbps(nbytes, timed(lambda: there_and_back("cpu"), 1)), unit="GB/s")
    emit("bandwidth", "module.to(cuda) again", gbps(nbytes, timed(lambda: there_and_back("cuda"), 1)), unit="GB/s")
    emit("bandwidth", "module.to(cpu) again", gbps(nbytes, timed(lambda: there_and_back("cpu"), 1)), unit="GB/s")


def section_pagelock():
    runtime = torch.cuda.cudart()
    emit("pagelock", "baseline kernel", error=kernel_ok())
    # 1. Already page-locked memory registered again.
    pinned = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    rc = code(runtime.cudaHostRegister(pinned.data_ptr(), pinned.numel(), 0))
    emit("pagelock", "cudaHostRegister on pin_memory() memory", code=rc, next_kernel_error=kernel_ok(),
         is_pinned=pinned.is_pinned())  # fmt: skip
    # 2. The same pageable range registered twice.
    host = torch.empty(64 << 20, dtype=torch.uint8)
    rc1 = code(runtime.cudaHostRegister(host.data_ptr(), host.numel(), 0))
    emit("pagelock", "first cudaHostRegister of pageable memory", code=rc1, next_kernel_error=kernel_ok(),
         is_pinned_after=host.is_pinned())  # fmt: skip
    rc2 = code(runtime.cudaHostRegister(host.data_ptr(), host.numel(), 0))
    emit("pagelock", "second cudaHostRegister of the same range", code=rc2, next_kernel_error=kernel_ok())
    # 3. Does the error stay set (sticky last error) and can it be cleared through the same runtime?
    path = loaded_library("libcudart")
    emit("pagelock", "libcudart loaded by torch", path=path)
    if path:
        lib = ctypes.CDLL(path)
        rc3 = code(runtime.cudaHostRegister(host.data_ptr(), host.numel(), 0))
        peeked = lib.cudaPeekAtLastError()
        cleared = lib.cudaGetLastError()
        emit("pagelock", "refusal then cudaGetLastError through torch's libcudart", code=rc3,
             peek=peeked, get=cleared, next_kernel_error=kernel_ok())  # fmt: skip
    try:
        from cuda.bindings import runtime as cuda_runtime

        rc4 = code(runtime.cudaHostRegister(host.data_ptr(), host.numel(), 0))
        got = cuda_runtime.cudaGetLastError()
        emit("pagelock", "refusal then cuda.bindings.runtime.cudaGetLastError", code=rc4, get=str(got),
             next_kernel_error=kernel_ok())  # fmt: skip
    except ImportError as error:
        emit("pagelock", "cuda.bindings", error=str(error))
    code(runtime.cudaHostUnregister(host.data_ptr()))
    emit("pagelock", "after unregister", next_kernel_error=kernel_ok(), is_pinned=host.is_pinned())
    # 4. The driver API: cuMemHostRegister leaves the runtime's last error alone?
    libcuda = ctypes.CDLL("libcuda.so.1")
    register = libcuda.cuMemHostRegister_v2
    register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    unregister = libcuda.cuMemHostUnregister
    unregister.argtypes = [ctypes.c_void_p]
    other = torch.empty(64 << 20, dtype=torch.uint8)
    d1 = register(other.data_ptr(), other.numel(), 0)
    emit("pagelock", "cuMemHostRegister (driver)", code=d1, is_pinned=other.is_pinned(), next_kernel_error=kernel_ok())
    d2 = register(other.data_ptr(), other.numel(), 0)
    emit("pagelock", "cuMemHostRegister twice (driver)", code=d2, next_kernel_error=kernel_ok())
    d3 = register(pinned.data_ptr(), pinned.numel(), 0)
    emit("pagelock", "cuMemHostRegister on pin_memory() memory (driver)", code=d3, next_kernel_error=kernel_ok())
    dev = torch.empty(other.numel(), dtype=torch.uint8, device="cuda")
    emit("pagelock", "h2d from driver-registered memory non_blocking",
         gbps(other.numel(), timed(lambda: dev.copy_(other, non_blocking=True))), unit="GB/s")  # fmt: skip
    emit("pagelock", "cuMemHostUnregister (driver)", code=unregister(other.data_ptr()), next_kernel_error=kernel_ok())
    # 5. An interior pointer of a registered range, and an unaligned start.
    big = torch.empty(64 << 20, dtype=torch.uint8)
    d4 = register(big.data_ptr() + 4096 + 3, (16 << 20) + 5, 0)
    emit("pagelock", "cuMemHostRegister unaligned start and size (driver)", code=d4, next_kernel_error=kernel_ok())
    if d4 == 0:
        unregister(big.data_ptr() + 4096 + 3)
    section_pagelock_neighbours(register, unregister)


def section_pagelock_neighbours(register, unregister):
    """Two neighbouring ranges of one mapping that share a page (safetensors' tensors): registered one after the
    other as they lie, page-rounded (as pinning/page_ranges.py registers), and the whole mapping at once, each with
    the portable flag; what the driver answers, whether the next kernel runs, and the copy rate from the second."""
    import mmap

    portable = 0x01
    page = mmap.PAGESIZE
    mapping = mmap.mmap(-1, 64 << 20)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    base = buffer.data_ptr()
    first, second = (base + 100, (16 << 20) + 7), (base + 100 + (16 << 20) + 7, 16 << 20)  # share one page
    a = register(first[0], first[1], portable)
    b = register(second[0], second[1], portable)
    emit("pagelock", "neighbours sharing a page, registered as they lie", first=a, second=b,
         next_kernel_error=kernel_ok())  # fmt: skip
    for start, code_ in ((first[0], a), (second[0], b)):
        if code_ == 0:
            unregister(start)
    end = -(-(first[0] + first[1]) // page) * page
    a = register(first[0] // page * page, end - first[0] // page * page, portable)
    b = register(end, -(-(second[0] + second[1]) // page) * page - end, portable)
    view = buffer[second[0] - base : second[0] - base + second[1]]
    dev = torch.empty(view.numel(), dtype=torch.uint8, device="cuda")
    emit("pagelock", "neighbours registered page-rounded, no page twice", first=a, second=b,
         next_kernel_error=kernel_ok(), is_pinned=view.is_pinned(),
         h2d_gbps=gbps(view.numel(), timed(lambda: dev.copy_(view, non_blocking=True))))  # fmt: skip
    if a == 0:
        unregister(first[0] // page * page)
    if b == 0:
        unregister(end)
    start = time.perf_counter()
    whole = register(base, buffer.numel(), portable)
    emit("pagelock", "the whole mapping at once (64 MiB)", code=whole, seconds=round(time.perf_counter() - start, 4),
         next_kernel_error=kernel_ok())  # fmt: skip
    if whole == 0:
        unregister(base)


def section_mapped(directory: str):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "probe.safetensors")
    tensors = {f"w{i}": torch.randn(4096, 4096, dtype=torch.bfloat16) for i in range(32)}  # 1 GiB
    save_file(tensors, path)
    del tensors
    runtime = torch.cuda.cudart()
    libcuda = ctypes.CDLL("libcuda.so.1")
    register = libcuda.cuMemHostRegister_v2
    register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    unregister = libcuda.cuMemHostUnregister
    unregister.argtypes = [ctypes.c_void_p]
    for how in ("load_file", "safe_open"):
        if how == "load_file":
            loaded = load_file(path, device="cpu")
        else:
            with safe_open(path, framework="pt", device="cpu") as f:
                loaded = {k: f.get_tensor(k) for k in f.keys()}
        t = loaded["w3"]
        storage = t.untyped_storage()
        emit("mapped", f"{how}: storage", storage_nbytes=storage.nbytes(), tensor_nbytes=t.numel() * 2,
             shared_storage_across_tensors=loaded["w4"].untyped_storage().data_ptr() == storage.data_ptr(),
             ptr_mod_4096=t.data_ptr() % 4096)  # fmt: skip
        dev = torch.empty(t.shape, dtype=t.dtype, device="cuda")
        nbytes = t.numel() * 2
        emit("mapped", f"{how}: h2d pageable", gbps(nbytes, timed(lambda: dev.copy_(t))), unit="GB/s")
        rc = code(runtime.cudaHostRegister(t.data_ptr(), nbytes, 0))
        emit("mapped", f"{how}: cudaHostRegister (runtime)", code=rc, next_kernel_error=kernel_ok())
        if rc == 0:
            emit("mapped", f"{how}: h2d registered non_blocking",
                 gbps(nbytes, timed(lambda: dev.copy_(t, non_blocking=True))), unit="GB/s")  # fmt: skip
            code(runtime.cudaHostUnregister(t.data_ptr()))
        rc = register(t.data_ptr(), nbytes, 0)
        emit("mapped", f"{how}: cuMemHostRegister (driver)", code=rc, next_kernel_error=kernel_ok())
        if rc == 0:
            emit("mapped", f"{how}: h2d driver-registered non_blocking",
                 gbps(nbytes, timed(lambda: dev.copy_(t, non_blocking=True))), unit="GB/s")  # fmt: skip
            unregister(t.data_ptr())
        rc = register(t.data_ptr(), nbytes, 2)  # CU_MEMHOSTREGISTER_DEVICEMAP
        emit("mapped", f"{how}: cuMemHostRegister DEVICEMAP (driver)", code=rc, next_kernel_error=kernel_ok())
        if rc == 0:
            unregister(t.data_ptr())
        # Copying once into a page-locked arena.
        arena = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        seconds = timed(lambda: arena.copy_(t.view(-1).view(torch.uint8)), 1)
        emit("mapped", f"{how}: copy into a pinned arena (host)", gbps(nbytes, seconds), unit="GB/s")
        del loaded, t, storage, arena


def section_pools():
    side = torch.cuda.Stream()
    torch.cuda.empty_cache()
    n = GIB
    with torch.cuda.stream(side):
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
    del x
    sync()
    before = torch.cuda.memory_reserved()
    y = torch.empty(n, dtype=torch.uint8, device="cuda")
    after = torch.cuda.memory_reserved()
    emit("pools", "freed on a side stream, then allocated on the compute stream", reserved_before=before,
         reserved_after=after, reused=after == before)  # fmt: skip
    del y
    torch.cuda.empty_cache()


def section_fingerprint():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from diffusers_offload_ext.transfer import fingerprint as module
    from diffusers_offload_ext.transfer.fingerprint import fingerprints

    for device, total in (("cuda", 4 * GIB), ("cpu", GIB // 4)):
        tensors = [torch.randn(3072, 3072, dtype=torch.bfloat16, device=device) for _ in range(total // (3072 * 6144))]
        tensors += [torch.randn(3072, dtype=torch.bfloat16, device=device) for _ in range(400)]
        nbytes = sum(t.numel() * 2 for t in tensors)
        read = timed(lambda: [t.sum() for t in tensors], 2)
        folded = timed(lambda: fingerprints(tensors), 2)
        copies = [t.clone() for t in tensors]
        equal = timed(lambda: all(torch.equal(a, b) for a, b in zip(tensors, copies)), 2)
        fused = any(key.startswith(device) and engine is not None for key, engine in module._engines.items())
        emit("fingerprint", f"{device}: fingerprints vs one plain read", bytes=nbytes, read_s=round(read, 4),
             fingerprint_s=round(folded, 4), ratio=round(folded / read, 2),
             fingerprint_s_per_gb=round(folded / nbytes * 1e9, 4), equal_s=round(equal, 4),
             engine="fused (Triton)" if fused else "eager")  # fmt: skip
        del tensors, copies


def section_tiny(directory: str):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import diffusers_offload_ext as doe
    from diffusers_offload_ext.testing import tiny

    doe.install()
    pipe = tiny.build("flux")
    path = os.path.join(directory, "tiny-flux")
    pipe.save_pretrained(path, safe_serialization=True)
    cls = type(pipe)
    kwargs = tiny.call_kwargs("flux")

    def image(p, mode):
        with mode():
            out = p(**{**kwargs, "generator": torch.Generator("cpu").manual_seed(0), "output_type": "pt"})
        return out.images.float().cpu()

    reference = cls.from_pretrained(path)
    reference.set_progress_bar_config(disable=True)
    reference.to("cuda")
    expected = image(reference, torch.no_grad)
    del reference
    sizes = {}
    cases = [
        ("stock", {}),
        ("exclude", {"exclude_from_offload": ["transformer"]}),
        ("keep-during", {"keep_on_device_during_generation": True}),
        ("residency", {"keep_on_device_between_generations": True}),
        ("zero-copy", {"zero_copy_eviction": True}),
        ("pin", {"pin_memory": True}),
        ("pin-prefetch-residency", {"pin_memory": True, "prefetch": True, "keep_on_device_between_generations": True}),
        ("prefetch-pageable", {"prefetch": True, "keep_on_device_between_generations": True}),
        ("stream-budget", {"memory_budget": "TRANSFORMER*0.6", "keep_on_device_between_generations": True}),
        ("stream-budget-pin-prefetch", {"memory_budget": "TRANSFORMER*0.6", "pin_memory": True, "prefetch": True,
                                        "keep_on_device_between_generations": True}),  # fmt: skip
    ]
    for mode_name, mode in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        for name, options in cases:
            p = cls.from_pretrained(path)
            p.set_progress_bar_config(disable=True)
            if "transformer" not in sizes:
                sizes["transformer"] = doe.module_nbytes(p.transformer)
            options = dict(options)
            if options.get("memory_budget", "").startswith("TRANSFORMER"):
                others = sum(doe.module_nbytes(m) for n, m in p.components.items()
                             if isinstance(m, torch.nn.Module) and n != "transformer")  # fmt: skip
                options["memory_budget"] = int(sizes["transformer"] * 0.6) + others
            try:
                p.enable_model_cpu_offload(device="cuda", **options)
                diffs = []
                for _ in range(3):
                    diffs.append(float((image(p, mode) - expected).abs().max()))
                ledger = doe.transfer_ledger(p).summary()["per_call"]
                status = doe.offload_status(p)
                emit("tiny", f"{mode_name} {name}", options=options, max_abs_diff=diffs,
                     bytes_per_call={str(k): v["total_bytes"] for k, v in ledger.items()},
                     pinned_bytes=status.pinned_bytes, next_kernel_error=kernel_ok())  # fmt: skip
                doe.release(p)
            except Exception as error:
                emit("tiny", f"{mode_name} {name}", options=options,
                     error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}",
                     where=traceback.format_exc().splitlines()[-4:], next_kernel_error=kernel_ok())  # fmt: skip
            del p


SECTIONS = ("bandwidth", "pagelock", "mapped", "pools", "fingerprint", "tiny")


def main(argv=None) -> int:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("section", choices=SECTIONS)
    parser.add_argument("--out", help="append each finding to this JSON-lines file")
    args = parser.parse_args(argv)
    OUT = args.out
    if not torch.cuda.is_available():
        print("No CUDA GPU here: nothing probed.")
        return 0
    torch.cuda.init()
    with tempfile.TemporaryDirectory() as directory:
        try:
            if args.section in ("mapped", "tiny"):
                globals()[f"section_{args.section}"](directory)
            else:
                globals()[f"section_{args.section}"]()
        except Exception as error:
            emit(args.section, "section failed", error=f"{type(error).__name__}: {error}",
                 where=traceback.format_exc().splitlines()[-6:])  # fmt: skip
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
