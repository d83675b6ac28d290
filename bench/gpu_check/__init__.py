"""One prepared check of the CUDA path: `python -m bench.gpu_check --device cuda --out DIR` (`make gpu-check`).

A GPU machine may be lent for minutes, bare and offline, so everything runs from one command that writes its
results to DIR (`gpu_check.json`, `gpu_check.md`, and each step's raw files) as it goes:

    env           GPU, driver, CUDA/cuDNN libraries found, ORT version and providers, what is missing (env.py)
    bundles       fp32 and fp16 bundles: exported from artifacts/ckpt/<task> when it exists, else from the
                  tiny preset fitted for a few steps (bundles.py)
    parity        fp32 and fp16 logits on the device vs PyTorch (CPU), 20-step lockstep decode of padded
                  mixed-length rows, greedy outputs identical (parity.py)
    kv_on_device  after warm-up a decode step moves no KV-cache bytes between host and device: ORT's
                  profiler shows no cache-shaped copy and no cache-shaped tensor on a host node, and the
                  bound cache addresses do not move (kv_on_device.py)
    engine        tokens/s by batching mode and concurrency; 32 concurrent requests == each alone, greedy
                  and seeded (engine.py)
    gpu_tests     the `gpu`-marked pytest tests (skipped without a GPU) (gpu_tests.py)
    server        a local Ray Serve app with the generate model on the device (`num_gpus: 1` on CUDA) and
                  `kvserve loadtest` at two client counts (server.py)

`--device cpu` (`make gpu-check-cpu`) runs the same steps on the CPU EP with a smaller plan (plan.py), so the
script itself is tested without a GPU. A step whose prerequisite is missing (no onnxruntime-gpu, no torch, no
ray, no pytest) is skipped with a line saying what is missing; the others still run. Exit status: 0 every
step ran and passed; 1 a check failed (parity, batch invariance, KV on the device, gpu tests, server); 2
nothing failed but a step was skipped or raised. The report is report.py's.
"""
