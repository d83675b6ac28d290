"""The gpu check's environment step: what the machine has, and what is missing for each later step.

Reports the GPU (nvidia-smi), the driver's CUDA version (libcuda), the CUDA and cuDNN libraries found on the
loader path and in pip's nvidia packages, onnxruntime's version, file and providers, the versions of torch,
ray and pytest (found without importing them), and whether a CUDA session really starts: ORT lists
CUDAExecutionProvider whenever onnxruntime-gpu is installed, but quietly runs on the CPU EP when the CUDA or
cuDNN libraries cannot be loaded. When they load only through `onnxruntime.preload_dlls()` (pip's nvidia
packages, off the loader path), it preloads them here and puts their directories on LD_LIBRARY_PATH, so the
Ray replicas this check starts find them too; a deployment must do the same (the report says so).

`missing` holds one plain sentence per missing piece; `usable` says which later steps can run.
Runs before torch is imported, so the CUDA session is tried as serving runs it: without torch's libraries.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.metadata
import importlib.util
import io
import os
import shutil
import subprocess
import sys
from typing import Any

from bench.gpu_check.plan import Step

CUDA_LIBS = ("libcudart.so", "libcublas.so", "libcublasLt.so", "libcudnn.so", "libcufft.so", "libcurand.so",
             "libnvrtc.so")
SYSTEM_DIRS = ("/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/lib")
# module -> (distribution name or None, the gate it belongs to); a gate's steps need all of its modules
MODULES = {"numpy": (None, "core"), "onnx": (None, "core"), "tokenizers": (None, "core"), "pydantic": (None, "core"),
           "yaml": ("pyyaml", "core"), "torch": (None, "export"), "onnxscript": (None, "export"),
           "safetensors": (None, "export"), "sacrebleu": (None, "export"), "ray": (None, "server"),
           "fastapi": (None, "server"), "httpx": (None, "server"), "prometheus_client": ("prometheus-client", "server"),
           "tqdm": (None, "server"), "matplotlib": (None, "server"), "pytest": (None, "pytest")}
NEEDED_BY = {"core": "every step", "export": "the bundle export and the parity step",
             "server": "the server step (Ray Serve and kvserve loadtest)", "pytest": "the gpu tests"}
INSTALL_ORT_GPU = ("install onnxruntime-gpu beforehand, e.g. `pip install --no-deps --target DIR "
                   "onnxruntime-gpu==1.31.1` and `PYTHONPATH=DIR`")


def version_of(module: str, dist: str | None = None) -> str | None:
    """The installed version of a module (None when it is not importable), without importing it."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError, AttributeError):  # e.g. a module blocked with sys.modules[name] = None
        return None
    try:
        return importlib.metadata.version(dist or module)
    except importlib.metadata.PackageNotFoundError:
        return "installed (version unknown)"


def nvidia_lib_dirs() -> list[str]:
    """lib directories of pip's nvidia-* packages (CUDA, cuBLAS, cuDNN wheels) on sys.path."""
    return sorted({d for p in sys.path if p for d in glob.glob(os.path.join(p, "nvidia", "*", "lib"))})


def find_libraries(dirs: list[str]) -> dict[str, str | None]:
    """First file of each CUDA library (any version suffix) in `dirs`, LD_LIBRARY_PATH and system dirs."""
    search = [*dirs, *os.environ.get("LD_LIBRARY_PATH", "").split(":"), *SYSTEM_DIRS]
    found: dict[str, str | None] = {}
    for lib in CUDA_LIBS:
        hits = [h for d in search if d for h in sorted(glob.glob(os.path.join(d, lib + "*")))]
        found[lib] = hits[0] if hits else None
    return found


def gpus() -> dict[str, Any]:
    """nvidia-smi's GPUs and driver, and the CUDA version the driver supports (from libcuda)."""
    out: dict[str, Any] = {"nvidia_smi": "nvidia-smi not found", "driver_cuda": "unknown (no libcuda.so.1)"}
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = r.stdout.strip().splitlines() if r.returncode == 0 else f"failed: {r.stderr.strip()}"
    try:
        cuda, v = ctypes.CDLL("libcuda.so.1"), ctypes.c_int(0)
        if cuda.cuDriverGetVersion(ctypes.byref(v)) == 0:
            out["driver_cuda"] = f"{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        pass
    return out


def cuda_session_starts() -> tuple[bool, str]:
    """Whether an ORT session asked for the CUDA EP really has it (a one-node graph)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            sess = ort.InferenceSession(model, so, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 -- reported, not raised
        return False, f"{type(e).__name__}: {e}"
    providers = sess.get_providers()
    return "CUDAExecutionProvider" in providers, f"session providers {providers}"


def onnxruntime_info(device: str, step: Step, missing: list[str]) -> bool:
    """ORT's facts into step.data; returns whether the device's EP is usable."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        missing.append(f"onnxruntime is not importable ({e}): every step needs it")
        return False
    info = step.data["onnxruntime"] = {"version": ort.__version__, "file": ort.__file__,
                                       "providers": ort.get_available_providers(), "device": ort.get_device()}
    if device == "cpu":
        return True
    if "CUDAExecutionProvider" not in info["providers"]:
        missing.append(f"onnxruntime {ort.__version__} at {ort.__file__} has no CUDAExecutionProvider (it is "
                       f"the CPU build): {INSTALL_ORT_GPU}")
        return False
    ok, detail = cuda_session_starts()
    info["cuda_session"] = detail
    if not ok and hasattr(ort, "preload_dlls"):
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            ort.preload_dlls(directory="")
        ok, detail = cuda_session_starts()
        info["preload_dlls"] = {"output": log.getvalue().strip().splitlines(), "cuda_session": detail}
        if ok:
            dirs = nvidia_lib_dirs()
            os.environ["LD_LIBRARY_PATH"] = ":".join([*dirs, os.environ.get("LD_LIBRARY_PATH", "")]).strip(":")
            info["note"] = ("the CUDA EP starts only after onnxruntime.preload_dlls() (CUDA/cuDNN from pip's "
                            "nvidia packages, off the loader path); LD_LIBRARY_PATH now lists them for the Ray "
                            "replicas: a deployment must set it too")
    if not ok:
        absent = [k for k, v in step.data["cuda_libraries"].items() if v is None]
        missing.append(f"a session asked for the CUDA EP did not get it ({detail}); CUDA libraries not found: "
                       f"{absent or 'none'} (onnxruntime-gpu 1.31 needs CUDA 13 and cuDNN 9)")
    return ok


def run(step: Step, device: str) -> dict[str, bool]:
    """Fill the env step; returns what later steps need: {"device", "onnxruntime", "torch", "ray", "pytest"}."""
    missing: list[str] = []
    step.data.update(python=sys.version.split()[0], executable=sys.executable, cpus=os.cpu_count(),
                     pythonpath=os.environ.get("PYTHONPATH"), **({"gpu": gpus()} if device == "cuda" else {}))
    if device == "cuda":
        step.data["cuda_libraries"] = find_libraries(nvidia_lib_dirs())
        step.data["nvidia_pip_lib_dirs"] = nvidia_lib_dirs()
    usable = {"device": onnxruntime_info(device, step, missing)}
    usable["onnxruntime"] = "onnxruntime" in step.data
    step.data["modules"] = {m: version_of(m, dist) for m, (dist, _) in MODULES.items()}
    for module, (_, gate) in MODULES.items():
        if step.data["modules"][module] is None:
            missing.append(f"{module} is not importable: {NEEDED_BY[gate]} cannot run")
    have = lambda gate: all(step.data["modules"][m] for m, (_, g) in MODULES.items() if g == gate)  # noqa: E731
    usable["onnxruntime"] = usable["onnxruntime"] and have("core")
    usable.update(torch=have("export"), ray=have("server"), pytest=have("pytest"))
    step.data["missing"] = missing
    step.data["usable"] = usable
    if missing:
        step.reason = "; ".join(missing)
    return usable
