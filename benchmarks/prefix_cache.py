"""The prefix cache on DeepSeek-V4's hybrid cache: (a) how far an `approximate` hit (the sliding window rebuilt by
prefilling the last R tokens again) moves the logits from a cold prefill of the same prompt, against `exact`
(a window snapshot restored at the hit); (b) a multi-turn chat workload run with the prefix cache off,
approximate and exact: hit rate against the workload's ideal, prefill tokens computed, time to first token.

    deepinfer compile --target sm90 --model benchmarks/configs/v4-flash-slice --jobs 16   (slice kernels, once)
    python benchmarks/prefix_cache.py --model slice [--part error|workload|both] [--replays 128,256,512,1024]
        [--conversations 32] [--turns 8] [--out results.json] [--commit SHA]
    python benchmarks/prefix_cache.py --model tiny --backend reference ...   (the embedded tiny model, CPU)

`slice` is benchmarks/decode.py's V4-Flash slice (random bf16 weights, CUDA; its engine is swapped into an LLM on
the tiny model for the tokenizer and request handling, as benchmarks/async_steps.py does). Part (a) drives the
cache and `V4Steps.prefill` directly: one cold reference run (prompt, then 64 greedy 1-token prefills), and per
mode a sequence that hits the shared prefix and is teacher-forced on the reference's path, then one that runs
greedily on its own. Part (b) uses `LLM.generate`, all conversations of a turn in one call, greedy, ignore_eos.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
BT = 128  # cache block tokens
CHUNK = 2048  # prefill chunk (the engine's default max_prefill_tokens)


def blocks(tokens: int) -> int:
    return -(-tokens // BT)


# ---- part (a): the error of approximate hits ----------------------------------------------------------------------
def run_seq(cache, steps, tokens: list[int], n_steps: int, force: list[int] | None = None, publish: bool = False,
            boundary: int = 0, chunk: int = CHUNK) -> dict:
    """A new sequence over `tokens`: prefix lookup, resume, prefill the rest in chunks, then `n_steps` 1-token
    prefills of `force` (teacher forcing) or of its own argmax. Released at the end. With `publish`, blocks are
    published as the engine does (and, exact mode, a snapshot is also planned at `boundary`)."""
    seq = cache.admit()
    hit = cache.lookup(cache.names_of(tokens))
    resume = cache.start(seq, hit, tokens)
    if publish and cache.prefix_mode.mode == "exact" and boundary > resume and boundary % BT == 0:
        seq.wanted = sorted(set(seq.wanted) | {boundary})
    assert cache.grow(seq, len(tokens) + n_steps + 1), "part (a) cache too small"
    for s in range(resume, len(tokens), chunk):
        take = min(chunk, len(tokens) - s)
        if publish:
            cache.plan_snapshots(seq, s, take)
        last = steps.prefill(tokens[s: s + take], list(range(s, s + take)), [(seq, 0, take)], [take - 1])
        if publish:
            cache.publish(seq, tokens[: s + take])
    rows, path, seen = [last], [int(last[-1].argmax())], list(tokens)
    for i in range(n_steps):
        token = force[i] if force is not None else path[-1]
        seen.append(token)
        last = steps.prefill([token], [len(seen) - 1], [(seq, 0, 1)], [0])
        rows.append(last)
        path.append(int(last[-1].argmax()))
        if publish:
            cache.publish(seq, seen)
    cache.release(seq)
    return {"logits": torch.cat(rows).float().cpu(), "path": path, "hit": hit.tokens, "resume": resume,
            "prefilled": len(tokens) - resume}


def compare(ref: dict, tf: dict, free: dict, n: int) -> dict:
    r, g = ref["logits"], tf["logits"]
    diff = float((r - g).abs().max())
    lr, lg = torch.log_softmax(r, -1), torch.log_softmax(g, -1)
    kl = (lr.exp() * (lr - lg)).sum(-1)
    pairs = list(zip(free["path"][:n], ref["path"][:n]))
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    return {"hit_tokens": tf["hit"], "replayed": tf["hit"] - tf["resume"], "prefilled": tf["prefilled"],
            "max_abs_diff": diff, "rel_diff": diff / float(r.abs().max()), "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()), "argmax_agree": float((r.argmax(-1) == g.argmax(-1)).float().mean()),
            "free_match": sum(a == b for a, b in pairs), "free_first_divergence": first}


def part_error(args, model, cfg, dtype) -> dict:
    from deepinfer.runtime.cache import CacheSpec, PagedCache
    from deepinfer.runtime.graph import DecodeGraphs
    from deepinfer.runtime.prefix import PrefixMode
    from deepinfer.runtime.steps import V4Steps

    gen = torch.Generator().manual_seed(args.seed)
    P, n = args.prefix_tokens, args.steps
    prompt = torch.randint(2, 1000, (P + args.suffix_tokens,), generator=gen).tolist()
    per_seq = blocks(len(prompt) + n + 1)

    def new_cache(mode: str, replay: int = 128):
        spec = CacheSpec(num_blocks=4 * per_seq, max_seqs=4, max_blocks_per_seq=per_seq,
                         snapshots=4 if mode == "exact" else 0)
        cache = PagedCache(cfg, spec, dtype, model.device)
        cache.enable_prefix(PrefixMode(mode, replay), cache.salt())
        return cache, V4Steps(model, cache, DecodeGraphs(model, cache, 1, None))

    rows = []
    with torch.inference_mode():
        exact, xsteps = new_cache("exact")
        ref = run_seq(exact, xsteps, prompt, n, publish=True, boundary=P)  # cold; snapshots at the prefix boundary
        tf = run_seq(exact, xsteps, prompt, n, force=ref["path"][:n])
        free = run_seq(exact, xsteps, prompt, n - 1)
        rows.append({"mode": "exact", "replay": 0, **compare(ref, tf, free, n)})
        # the noise floor: the same cold run, its prompt prefilled in other chunks (no cache); in bf16 a row's bits
        # depend on the chunk it is computed in, and a random model's routing amplifies that
        off, osteps = new_cache("off")
        tf = run_seq(off, osteps, prompt, n, force=ref["path"][:n], chunk=1000)
        free = run_seq(off, osteps, prompt, n - 1, chunk=1000)
        rows.append({"mode": "cold, chunks of 1000", "replay": 0, **compare(ref, tf, free, n)})
        approx, asteps = new_cache("approximate")
        run_seq(approx, asteps, prompt[:P], 0, publish=True)  # publish the shared prefix only
        for R in [int(x) for x in args.replays.split(",")]:
            approx.prefix_mode = PrefixMode("approximate", R)
            tf = run_seq(approx, asteps, prompt, n, force=ref["path"][:n])
            free = run_seq(approx, asteps, prompt, n - 1)
            rows.append({"mode": "approximate", "replay": R, **compare(ref, tf, free, n)})
        leaks = {"exact": exact.used_blocks, "approximate": approx.used_blocks, "off": off.used_blocks}
    assert all(v == 0 for v in leaks.values()), f"blocks still referenced after every release: {leaks}"
    print(f"\n## (a) approximate vs exact: {P} shared + {args.suffix_tokens} prompt tokens, {n} greedy steps "
          f"(teacher-forced on the cold run's path; {n + 1} logit rows), window {cfg.sliding_window}")
    print("| mode | replay R | hit | replayed | prefilled | max abs diff | rel | KL mean | KL max | argmax agree "
          "| free-run match | first divergence |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['replay'] or '-'} | {r['hit_tokens']} | {r['replayed']} | {r['prefilled']} | "
              f"{r['max_abs_diff']:.3e} | {r['rel_diff']:.2e} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | "
              f"{r['argmax_agree']:.3f} | {r['free_match']}/{n} | {r['free_first_divergence']} |", flush=True)
    return {"prefix_tokens": P, "suffix_tokens": args.suffix_tokens, "steps": n, "rows": rows,
            "used_blocks_after": leaks}


# ---- part (b): a multi-turn workload ------------------------------------------------------------------------------
def ideal_tokens(tokens: list[int], seen: set[bytes]) -> int:
    """Tokens of `tokens`' longest prefix (whole blocks, at most len-1) found among the prefixes in `seen`."""
    from deepinfer.runtime.prefix import block_names

    k = 0
    for name in block_names(tokens[: len(tokens) - 1], BT, b"ideal"):
        if name not in seen:
            break
        k += 1
    return k * BT


def part_workload(args, factory) -> dict:
    from deepinfer.runtime.prefix import block_names
    from deepinfer.runtime.sampling import SamplingParams

    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.user_tokens.split("-"))
    C, T = args.conversations, args.turns
    system = [rng.randint(2, 1000) for _ in range(args.system_tokens)]
    users = [[[rng.randint(2, 1000) for _ in range(rng.randint(lo, hi))] for _ in range(T)] for _ in range(C)]
    warm = [{"token_ids": [rng.randint(2, 1000) for _ in range(args.system_tokens + hi)]} for _ in range(min(C, 4))]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    modes, ttft = {}, {}
    for mode in ("off", "approximate", "exact"):
        llm, cache = factory(mode)
        llm.generate(warm, params, use_tqdm=False)  # kernels, graphs, allocator: not measured
        hist = [list(system) for _ in range(C)]
        seen, seen_before = set(), set()  # prefixes of every earlier request / of earlier turns' requests
        m = dict(input=0, cached=0, prompt=0, replayed=0, wall=0.0, prefill_s=0.0, decode_s=0.0, ideal=0, ideal_prev=0)
        ttft[mode] = {}
        for t in range(T):
            prompts = [hist[c] + users[c][t] for c in range(C)]
            begin = time.perf_counter()
            outs = llm.generate([{"token_ids": p} for p in prompts], params, use_tqdm=False)
            m["wall"] += time.perf_counter() - begin
            st = llm.last_stats
            m["input"] += st.input_tokens
            m["cached"] += st.cached_tokens
            m["prompt"] += st.prompt_tokens
            m["replayed"] += st.replayed_tokens
            m["prefill_s"] += st.prefill_seconds
            m["decode_s"] += st.decode_seconds
            for c, (p, o) in enumerate(zip(prompts, outs)):
                m["ideal"] += ideal_tokens(p, seen)
                m["ideal_prev"] += ideal_tokens(p, seen_before)
                hist[c] = p + list(o.token_ids)
                seen.update(block_names(hist[c], BT, b"ideal"))
                ttft[mode][(t, c)] = (o.time_to_first_token, o.num_cached_tokens)
            for c in range(C):
                seen_before.update(block_names(hist[c], BT, b"ideal"))
        hits = [k for k, (_, cached) in ttft[mode].items() if cached > 0]
        row = {"mode": mode, "requests": C * T, "hit_requests": len(hits), "input_tokens": m["input"],
               "cached_tokens": m["cached"], "hit_rate": m["cached"] / m["input"],
               "ideal_hit_rate": m["ideal"] / m["input"], "ideal_hit_rate_prev_turns": m["ideal_prev"] / m["input"],
               "prefill_tokens": m["prompt"], "replayed_tokens": m["replayed"], "wall_s": m["wall"],
               "prefill_s": m["prefill_s"], "decode_s": m["decode_s"],
               "ttft_all_ms": 1e3 * sum(v for v, _ in ttft[mode].values()) / len(ttft[mode]),
               "ttft_hits_ms": 1e3 * sum(ttft[mode][k][0] for k in hits) / len(hits) if hits else None,
               "hits": hits}
        if mode == "exact":
            row["snapshots"] = cache.spec.snapshots
            row["snapshots_held"] = len(cache.prefix.snapshot_of)
            row["snapshot_bytes"] = cache.snapshot_bytes()
        modes[mode] = row
        del llm, cache
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for row in modes.values():  # TTFT of the hits against the same requests with the cache off
        hits = row.pop("hits")
        row["ttft_off_same_ms"] = 1e3 * sum(ttft["off"][k][0] for k in hits) / len(hits) if hits else None
        row["ttft_ratio"] = row["ttft_hits_ms"] / row["ttft_off_same_ms"] if hits else None
    print(f"\n## (b) workload: {C} conversations x {T} turns, system {args.system_tokens}, user {lo}-{hi}, "
          f"{args.new_tokens} new tokens (greedy), turn t = system + user_1 + output_1 + ... + user_t")
    print("| mode | hit rate | ideal (any earlier / earlier turns) | hit requests | prefill tokens | replayed | "
          "TTFT all ms | TTFT hits ms | TTFT same requests, off ms | hits / off | wall s (prefill / decode) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in modes.values():
        print(f"| {r['mode']} | {r['hit_rate']:.3f} | {r['ideal_hit_rate']:.3f} / "
              f"{r['ideal_hit_rate_prev_turns']:.3f} | "
              f"{r['hit_requests']}/{r['requests']} | {r['prefill_tokens']} | {r['replayed_tokens']} | "
              f"{r['ttft_all_ms']:.1f} | {fmt(r['ttft_hits_ms'], '.1f')} | {fmt(r['ttft_off_same_ms'], '.1f')} | "
              f"{fmt(r['ttft_ratio'], '.2f')} | {r['wall_s']:.2f} ({r['prefill_s']:.2f} / {r['decode_s']:.2f}) |",
              flush=True)
    x = modes["exact"]
    print(f"exact mode: {x['snapshots']} window snapshots ({x['snapshots_held']} held at the end), "
          f"{x['snapshot_bytes'] / 2**20:.1f} MiB")
    return {"conversations": C, "turns": T, "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
            "new_tokens": args.new_tokens, "replay": args.workload_replay, "modes": list(modes.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("error", "workload", "both"), default="both")
    parser.add_argument("--model", choices=("tiny", "slice"), default="slice")
    parser.add_argument("--backend", default=None, help="tiny: e.g. reference (CPU); slice: nvidia (default)")
    parser.add_argument("--replays", default="128,256,512,1024", help="part (a): approximate mode's replay R")
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64, help="part (a): greedy steps after the prompt")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--user-tokens", default="64-256", help="per turn, drawn uniformly (lo-hi)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--workload-replay", type=int, default=128, help="part (b): approximate mode's replay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import deepinfer
    from deepinfer.runtime.prefix import PrefixMode

    C = args.conversations
    hi = int(args.user_tokens.split("-")[1])
    per_seq = blocks(args.system_tokens + args.turns * (hi + args.new_tokens) + 1) + 1
    num_blocks = (C + 4) * (per_seq + args.turns)  # every history, each turn's private last block, the warm-up
    tiny = args.model == "tiny"
    backend = args.backend or (None if tiny else "nvidia")
    base = deepinfer.LLM(backend=backend, prefix_cache="off", max_num_seqs=C, num_blocks=num_blocks,
                         max_model_len=per_seq * BT)
    if tiny:
        model, cfg = base.model, base.config
    else:
        import decode as bench
        from deepinfer.config import ModelConfig
        from deepinfer.model.model import DeepseekV4
        from deepinfer.model.weights import ModelWeights
        from deepinfer.tiny import random_tensors

        cfg = ModelConfig.from_model_dir(bench.SLICE)
        model = DeepseekV4(cfg, ModelWeights.from_tensors(cfg, random_tensors(cfg, seed=0, dtype=torch.bfloat16,
                                                                              device="cuda")), base.backend.ops)
    dtype = model.dtype

    def factory(mode: str):
        """An LLM whose engine runs `mode`'s prefix cache over a fresh cache (tiny: a new LLM; slice: the base LLM
        with a new cache and engine over the slice swapped in)."""
        if tiny:
            llm = deepinfer.LLM(backend=backend, prefix_cache=mode, max_num_seqs=C, num_blocks=num_blocks,
                                max_model_len=per_seq * BT)
            cache = llm.cache
        else:
            from deepinfer.runtime.cache import CacheSpec, PagedCache
            from deepinfer.runtime.engine import Engine
            from deepinfer.runtime.graph import DecodeGraphs
            from deepinfer.runtime.scheduler import SchedulerConfig
            from deepinfer.runtime.steps import V4Steps

            base.engine = base.cache = None
            spec = CacheSpec(num_blocks, C, per_seq, snapshots=4 * C if mode == "exact" else 0)
            cache = PagedCache(cfg, spec, dtype, "cuda")
            cache.enable_prefix(PrefixMode(mode, args.workload_replay), cache.salt())
            # a new capture (its own graph pool): the previous mode's graphs are gone with its engine
            steps = V4Steps(model, cache, DecodeGraphs(model, cache, C, type(base.backend.capture)()))
            engine = Engine(steps, cache, SchedulerConfig(C, CHUNK, True), base.grammars)
            engine.capture_all()
            base.engine, base.cache, llm = engine, cache, base
        if mode == "approximate":
            cache.prefix_mode = PrefixMode("approximate", args.workload_replay)
        return llm, cache

    device = torch.cuda.get_device_name() if model.device.type == "cuda" else str(model.device)
    results = {"device": device, "date": str(datetime.date.today()), "commit": args.commit, "model": args.model,
               "dtype": str(dtype).removeprefix("torch."), "seed": args.seed}
    print(f"# {device} | {results['date']} | commit {args.commit} | "
          f"{'V4-Flash slice' if not tiny else 'tiny model'} ({results['dtype']}), prefix cache benchmark")
    if args.part in ("error", "both"):
        results["error"] = part_error(args, model, cfg, dtype)
    if args.part in ("workload", "both"):
        results["workload"] = part_workload(args, factory)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
