"""Engine start, warmup and block-report figures on simulated cards, for the closing note.

    .venv/bin/python bench/engine_start.py [--models tiny smollm2] [--tp 1 2] [--warm-start]

Prints a table and writes bench/results/engine_start.json. With --warm-start each model and
TP size starts twice against one empty warm-start catalog (a directory): cold, on a "node"
whose compile cache is empty, then warm, on another node whose compile cache is empty too,
so only the catalog can make it warm. Targets: warm start <= 0.5x cold, warmup <= 0.3x cold.
"""
import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path

def measure(model_name: str, model_path: str, tp: int, max_model_len: int, card_bytes: int,
            **spyre) -> dict:
    from vllm import SamplingParams

    from spyre_serve.handshake.coordinator import replica_status
    from spyre_serve.vllm_plugin.engine import engine_kwargs, start_llm
    started = time.perf_counter()
    llm = start_llm(engine_kwargs(model_path, tensor_parallel_size=tp, max_model_len=max_model_len,
                                  max_num_seqs=8, spyre={"card_memory_bytes": card_bytes,
                                                                **spyre}))
    start_s = time.perf_counter() - started
    t = time.perf_counter()
    llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0.0))
    first_s = time.perf_counter() - t
    status = replica_status(llm.collective_rpc("spyre_status"))
    llm.llm_engine.engine_core.shutdown()
    return {
        "model": model_name, "tp": tp, "max_model_len": max_model_len,
        "engine_start_s": round(start_s, 2), "first_token_after_start_s": round(first_s, 3),
        "num_blocks": status["num_blocks"], "limiting_rank": status["limiting_rank"],
        "start": status["warm_start"].get("state", "off"),
        "warmup_s": round(max(r["warmup"]["seconds"] for r in status["ranks"]), 2),
        "catalog_key": status["warm_start"].get("key"),
        "ranks": [{"rank": r["rank"], "device": r["device"],
                   "warmup_s": round(r["warmup"]["seconds"], 2),
                   "warmup_steps": r["warmup"]["steps"],
                   "compile_cache": r["warmup"]["compile_cache"],
                   "reported_blocks": rep["num_blocks"],
                   "weights_MiB": round(rep["weights_bytes"] / 2**20, 1),
                   "activation_peak_MiB": round(rep["activation_peak_bytes"] / 2**20, 1),
                   "KiB_per_block": rep["bytes_per_block"] / 1024}
                  for r, rep in zip(status["ranks"], status["reports"])],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--card-memory-mib", type=int, default=2048,
                        help="simulated card budget (the KV cache fills what the model leaves)")
    parser.add_argument("--warm-start", action="store_true",
                        help="each start twice: cold, then warm from the catalog on a new node")
    parser.add_argument("--out", default="bench/results/engine_start.json")
    args = parser.parse_args()

    import ray

    from spyre_serve.ops import models
    paths = {"tiny": lambda: str(models.tiny_llama()), "smollm2": lambda: str(models.smollm2())}
    # A private local cluster every time (address="local", its own temp dir): a Ray left
    # running on this machine is never joined.
    ray.init(address="local", resources={"spyre": 8}, include_dashboard=False,
             log_to_driver=False, _temp_dir=tempfile.mkdtemp(prefix="rt-bench-", dir="/tmp"))
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    results = []
    for m in args.models:
        path = paths[m]()
        heads = json.loads((Path(path) / "config.json").read_text())["num_attention_heads"]
        for tp in args.tp:
            if heads % tp:
                print(f"{m}: tensor_parallel_size={tp} is impossible ({heads} attention heads)")
                continue
            run = functools.partial(measure, m, path, tp, 1024 if m == "tiny" else 2048,
                                    args.card_memory_mib * 2**20)
            if not args.warm_start:
                results.append(run())
                continue
            root = Path(tempfile.mkdtemp(prefix="warm-bench-"))
            where = {"cache_uri": str(root / "catalog")}
            cold = run(**where, compile_cache_dir=str(root / "node-a"))
            warm = run(**where, compile_cache_dir=str(root / "node-b"))
            entry = root / "catalog" / f"{cold['catalog_key']}.json"
            warm["catalog_entry_bytes"] = entry.stat().st_size
            warm["vs_cold"] = {
                "engine_start": round(warm["engine_start_s"] / cold["engine_start_s"], 2),
                "warmup": round(warm["warmup_s"] / cold["warmup_s"], 2),
                # The lowest engine-start ratio a warm start could reach if its warmup took
                # no time at all: what the cold start spent outside warmup (processes,
                # imports, weights) is paid warm or cold.
                "engine_start_if_warmup_were_free": round(
                    (cold["engine_start_s"] - cold["warmup_s"]) / cold["engine_start_s"], 2)}
            warm["targets"] = {
                "engine_start <= 0.5x cold": warm["vs_cold"]["engine_start"] <= 0.5,
                "warmup <= 0.3x cold": warm["vs_cold"]["warmup"] <= 0.3,
                "started warm": warm["start"].startswith("warm (catalog")}
            results += [cold, warm]
    ray.shutdown()
    print(f"{'model':>8} {'tp':>2} {'start s':>8} {'warmup s':>8} {'first s':>8} {'blocks':>7}  "
          f"{'start':<28} per-rank "
          "(warmup s, reported blocks, weights MiB, activation MiB, KiB/block)")
    for r in results:
        ranks = "; ".join(f"r{x['rank']}: {x['warmup_s']}s {x['reported_blocks']} "
                          f"{x['weights_MiB']} {x['activation_peak_MiB']} {x['KiB_per_block']:.0f}"
                          for x in r["ranks"])
        print(f"{r['model']:>8} {r['tp']:>2} {r['engine_start_s']:>8} {r['warmup_s']:>8} "
              f"{r['first_token_after_start_s']:>8} {r['num_blocks']:>7}  {r['start']:<28} {ranks}")
        if "targets" in r:
            print(f"{'':>8} warm vs cold: {r['vs_cold']}, catalog entry "
                  f"{r['catalog_entry_bytes'] / 1024:.0f} KiB; " + ", ".join(
                      f"{name}: {'PASS' if ok else 'FAIL'}" for name, ok in r["targets"].items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine_cpus": os.cpu_count(), "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
