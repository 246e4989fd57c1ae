"""Speculative decoding's speed with acceptance set from outside: decode tokens/s of speculative runs (drafts from
`OracleDrafts`: the plain run's own greedy tokens, each kept with probability `accept`, since random weights
accept nothing) against plain decoding of the same requests, by batch, per-position acceptance and draft length
k; the measured acceptance per draft position, tokens per request-step and verify tokens per step; whether the
speculative tokens equal the plain ones (mismatching requests counted, not asserted: bf16 paths may differ); and
the verify step's cost against the tokens it verifies per request (k = 0..5, every draft right).

    python benchmarks/speculative.py [--batches 1,8,32,64] [--accepts 0.9,0.8,0.6] [--ks 1,2,3,4,5]
        [--cost-ks 0,1,2,3,4,5] [--prompt-tokens 64] [--new-tokens 64] [--commit SHA] [--out results.json]
    python benchmarks/speculative.py --model tiny --quick    # the embedded tiny model on the CPU, a small grid

`--model slice` (default): the V4-Flash slice (benchmarks/decode.py's SLICE config, random bf16 weights on CUDA,
without its MTP tensors: the oracle drafts), its plain decode steps in CUDA graphs as in benchmarks/async_steps.py;
an LLM on the embedded tiny model gives the tokenizer and request handling, its engine is replaced by one over the
slice. `--model tiny`: `LLM(backend="reference")`'s own embedded tiny model, eager on the CPU. Either way the engine
and its cache are built here, the cache with `CacheSpec.lookahead` = the largest k (ring room for verify rows a
step writes and does not keep) and decode graphs for up to batch x (1 + k) rows (verify steps replay them). Speculative runs set `engine.speculator` on the same engine (None: plain
decoding). Each configuration runs twice (the first also warms up kernel builds and graph captures); the faster run
is reported. Greedy, `ignore_eos=True`. With the default kernels a verify step of more than 32 rows runs other
kernel variants than plain decoding's steps, whose last bits differ; on random weights that flips near-tie greedy
tokens and the oracle's continuation stops matching (the mismatch column counts it; BENCHMARKS.md): pass
`--batch-invariant` (both runs on those kernels, one variant for every row count) to measure those batches.
`--drafter mtp|dspark` (slice): the slice carries that drafter (its MTP layer, or `DSPARK_SLICE`'s DSpark blocks)
and the drafter runs every step as it would (its time counted in the step and reported per verify step), while
the oracle's drafts are the ones verified; the slice has 4 target layers where V4-Flash has 43, so the drafter's
share of a step here is about ten times what it is on the whole model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


# The slice's DSpark drafter (`--drafter dspark`): V4-Flash-DSpark's block size, noise token and Markov rank; it
# reads the slice's last three layers as the released one reads V4-Flash's last three (40, 41, 42); its experts
# (not public for V4-Flash) as V4.1-Flash's drafter has them: 128, top 3.
DSPARK_SLICE = {"num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
                "dspark_target_layer_ids": [1, 2, 3], "dspark_markov_rank": 256, "dspark_n_routed_experts": 128,
                "dspark_num_experts_per_tok": 3}


def build(name: str, top: int, positions: int, lookahead: int, invariant: bool = False, drafter: str = "oracle"):
    """An LLM (the embedded tiny model: tokenizer, grammars, request handling) whose engine runs `name`'s model
    (slice: V4-Flash slice, random bf16 weights, CUDA graphs; tiny: the LLM's own model, eager on the CPU) over a
    cache for `top` requests of `positions` positions; returns (llm, engine, vocab, device). `lookahead`: the
    verify rows a step may write past those it keeps (where `CacheSpec` takes it). `drafter` (slice): "oracle"
    (no drafter weights), "mtp" (the slice's MTP layer) or "dspark" (`DSPARK_SLICE`) loaded and given its rings."""
    import deepinfer
    from deepinfer.runtime.cache import CacheSpec, PagedCache
    from deepinfer.runtime.engine import Engine
    from deepinfer.runtime.graph import DecodeGraphs
    from deepinfer.runtime.scheduler import SchedulerConfig
    from deepinfer.runtime.steps import V4Steps

    llm = deepinfer.LLM(backend="nvidia" if name == "slice" else "reference", max_num_seqs=top,
                        prefix_cache="off", speculative_tokens=0, batch_invariant=invariant)
    if name == "slice":
        import decode as bench
        from deepinfer.config import ModelConfig
        from deepinfer.model.model import DeepseekV4
        from deepinfer.model.weights import ModelWeights
        from deepinfer.tiny import random_tensors

        raw = json.loads((bench.SLICE / "config.json").read_text())
        cfg = ModelConfig.from_dict(dict(raw, **DSPARK_SLICE) if drafter == "dspark" else raw)
        dtype, device = torch.bfloat16, "cuda"
        tensors = {k: t for k, t in random_tensors(cfg, seed=0, dtype=dtype, device=device).items()
                   if drafter != "oracle" or not k.startswith("mtp.")}  # oracle: no drafter (~25% of the memory)
        torch.cuda.empty_cache()
        model = DeepseekV4(cfg, ModelWeights.from_tensors(cfg, tensors), llm.backend.ops)
        label = torch.cuda.get_device_name()
    else:
        model, cfg, dtype, device = llm.model, llm.config, llm.cache.dtype, llm.model.device
        label = f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    per_seq = -(-positions // 128)
    cache = PagedCache(cfg, CacheSpec(num_blocks=top * per_seq, max_seqs=top, max_blocks_per_seq=per_seq,
                                      lookahead=lookahead, draft_layers=model.weights.draft_layers), dtype, device)
    # graphs for up to top x (1 + lookahead) rows: a verify step's rows replay them as plain decode steps do
    steps = V4Steps(model, cache, DecodeGraphs(model, cache, top * (1 + lookahead), llm.backend.capture,
                                               hidden=drafter != "oracle"))
    engine = Engine(steps, cache, SchedulerConfig(top, 2048, True), llm.grammars)
    engine.capture_all()
    llm.cache, llm.engine = cache, engine
    return llm, engine, cfg.vocab_size, label


class Costed:
    """A drafter's work (its cost: it reads every step and drafts) with the oracle's drafts (acceptance set from
    outside); `seconds` / `calls`: the drafter's time after verify steps (the device synchronized around each
    call) since the last `reset`."""

    def __init__(self, drafter, oracle):
        self.drafter, self.oracle, self.seconds, self.calls = drafter, oracle, 0.0, 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def capture_all(self) -> None:
        getattr(self.drafter, "capture_all", lambda: None)()

    def after_prefill(self, *args) -> None:
        self.drafter.after_prefill(*args)
        self.oracle.after_prefill(*args)

    def after_verify(self, *args) -> None:
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        begin = time.perf_counter()
        self.drafter.after_verify(*args)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        self.seconds, self.calls = self.seconds + time.perf_counter() - begin, self.calls + 1
        self.oracle.after_verify(*args)


def run(llm, items, params, reference=None, source=None):
    """Two runs of the same requests (the first warms up builds and captures); the faster one's stats and its
    drafter ms per verify step (`source`: a `Costed`; 0 without), and the most requests whose tokens differed from
    `reference`'s in either run (None without a reference)."""
    best, mismatches, draft_ms = None, None, 0.0
    for _ in range(2):
        if source is not None:
            source.reset()
        out = llm.generate(items, params, use_tqdm=False)
        st = llm.last_stats
        if best is None or st.decode_seconds < best.decode_seconds:
            best = st
            draft_ms = 1e3 * source.seconds / max(source.calls, 1) if source is not None else 0.0
        if reference is not None:
            bad = sum(o.token_ids != r.token_ids for o, r in zip(out, reference))
            mismatches = max(bad, mismatches or 0)
    return out, best, mismatches, draft_ms


def tok_s(st) -> float:
    return st.decode_tokens / st.decode_seconds if st.decode_seconds else 0.0


def step_ms(st) -> float:
    return 1e3 * st.decode_seconds / max(st.decode_steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("slice", "tiny"), default="slice")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--accepts", default="0.9,0.8,0.6", help="per-position acceptance of the oracle drafts")
    parser.add_argument("--ks", default="1,2,3,4,5", help="draft tokens per request and step")
    parser.add_argument("--cost-ks", default="0,1,2,3,4,5", help="draft lengths of the verify-cost table")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a small grid where not given: batches 1,4, "
                        "accept 0.8, k 1,3, cost k 0,2,4, 32-token prompts and outputs")
    parser.add_argument("--batch-invariant", action="store_true", help="batch-invariant kernels for both runs")
    parser.add_argument("--drafter", choices=("oracle", "mtp", "dspark"), default="oracle",
                        help="slice: also run this drafter every step (its cost counted; the oracle's drafts used)")
    parser.add_argument("--concentration", type=float, default=None,
                        help="each oracle draft's acceptance probability drawn from a Beta of mean `accept` and this "
                             "concentration, reported as its confidence (informative confidences, as a trained head "
                             "gives); default: every draft's probability is `accept`")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the grid of an acceptance this many times, interleaved; each figure is its best "
                             "round (drift between configurations measured minutes apart cancels)")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=None)
    parser.add_argument("--render", default=None, help="print the tables of a results JSON file and exit")
    args = parser.parse_args()
    if args.render:
        results = json.loads(Path(args.render).read_text())
        render(results, f"# {results['device']} | {results['date']} | commit {results['commit']} | "
                        f"{results['model']} | {results['prompt_tokens']}-token prompts, {results['new_tokens']} "
                        f"new tokens, greedy | oracle concentration {results.get('concentration')} | best of "
                        f"{results.get('rounds', 1)} round(s)")
        return
    if args.quick:  # the options left at their defaults
        quick = {"batches": "1,4", "accepts": "0.8", "ks": "1,3", "cost_ks": "0,2,4", "prompt_tokens": 32,
                 "new_tokens": 32}
        for key, value in quick.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)

    from deepinfer.runtime.drafters import OracleDrafts
    from deepinfer.runtime.sampling import SamplingParams
    from deepinfer.runtime.speculative import Speculator

    if args.drafter != "oracle" and args.model != "slice":
        parser.error(f"--drafter {args.drafter} runs on --model slice (the embedded tiny model has no drafter)")
    from deepinfer.runtime.drafters import DSparkDrafts, MTPDrafts

    batches, accepts, ks, cost_ks = ints(args.batches), floats(args.accepts), ints(args.ks), ints(args.cost_ks)
    top = max(batches)
    llm, engine, vocab, device = build(args.model, top, args.prompt_tokens + args.new_tokens + 1,
                                       max(ks + cost_ks), args.batch_invariant, args.drafter)
    model_name = {"slice": f"V4-Flash slice (random bf16 weights, CUDA graphs for plain decode steps), drafts: "
                           f"{'oracle' if args.drafter == 'oracle' else f'oracle, {args.drafter} drafter run (cost)'}",
                  "tiny": "embedded tiny model (reference backend, CPU, eager)"}[args.model]
    results = {"device": device, "date": str(datetime.date.today()), "commit": args.commit, "model": args.model,
               "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "speed": [], "cost": [],
               "drafter": args.drafter, "concentration": args.concentration, "rounds": args.rounds}
    oracle = (f"oracle confidences Beta(mean accept, concentration {args.concentration})"
              if args.concentration is not None else "oracle confidences = accept")
    header = (f"# {device} | {results['date']} | commit {args.commit} | {model_name} | {args.prompt_tokens}-token "
              f"prompts, {args.new_tokens} new tokens, greedy | {oracle} | best of {args.rounds} interleaved round(s)")
    print(header, file=sys.stderr, flush=True)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    plain, speed, cost = {}, [], []
    for batch in batches:
        items = [{"token_ids": torch.randint(2, min(1000, vocab), (args.prompt_tokens,), generator=gen).tolist()}
                 for _ in range(batch)]
        engine.speculator = None
        reference, st, _, _ = run(llm, items, [params] * batch)
        plain[batch] = st
        continuations = {i: o.token_ids for i, o in enumerate(reference)}

        def speculative(k: int, accept: float, varlen: bool = False):
            source = OracleDrafts(continuations, accept, vocab,
                                  concentration=args.concentration if 0 < accept < 1 else None)
            if args.drafter != "oracle":
                drafter = (DSparkDrafts(engine.steps.model, engine.cache, engine.steps.capture)  # its graphs
                           if args.drafter == "dspark" else MTPDrafts(engine.steps.model, engine.cache))
                source = Costed(drafter, source)
            engine.speculator = Speculator(engine.steps, k, source, varlen)
            engine.speculator.profile()  # sized verification: each captured bucket's cost
            try:
                _, s, bad, ms = run(llm, items, [params] * batch, reference,
                                    source if isinstance(source, Costed) else None)
            finally:
                engine.speculator = None
            return s, bad, ms

        for accept in accepts:
            best = {}
            for _ in range(args.rounds):
                for k in ks + ["sized"]:
                    got = speculative(max(ks), accept, True) if k == "sized" else speculative(k, accept)
                    if k not in best or got[0].decode_seconds < best[k][0].decode_seconds:
                        best[k] = got
            for k in ks + ["sized"]:
                s, bad, ms = best[k]
                sp = s.spec
                row = {"batch": batch, "accept": accept, "k": k, "plain_tok_s": tok_s(st), "spec_tok_s": tok_s(s),
                       "speedup": tok_s(s) / tok_s(st) if tok_s(st) else 0.0, "acceptance": sp.acceptance,
                       "tokens_per_request_step": sp.mean_accepted,
                       "verify_tokens_per_step": sp.verify_tokens / max(sp.steps, 1), "spec_steps": sp.steps,
                       "plain_steps": st.decode_steps, "mismatched_requests": bad,
                       "generated_tokens": s.generated_tokens, "draft_ms": ms}
                speed.append(row)
                print(f"  batch {batch} accept {accept} k {k}: {row['spec_tok_s']:.1f} tok/s "
                      f"({row['speedup']:.2f}x), {bad} mismatched", file=sys.stderr, flush=True)
        for k in cost_ks:
            s, bad, ms = speculative(k, 1.0)
            sp = s.spec
            row = {"batch": batch, "k": k, "plain_step_ms": step_ms(st), "step_ms": step_ms(s),
                   "verified_per_request": sp.verify_tokens / max(sp.steps * batch, 1),
                   "ms_per_verified_token": 1e3 * s.decode_seconds / max(sp.verify_tokens, 1),
                   "spec_tok_s": tok_s(s), "plain_tok_s": tok_s(st), "mismatched_requests": bad,
                   "draft_ms": ms}
            cost.append(row)
            print(f"  batch {batch} cost k {k}: {row['step_ms']:.3f} ms/step", file=sys.stderr, flush=True)
        results["speed"], results["cost"] = speed, cost
        if args.out:  # after every batch: a run cut short keeps what it measured (`--render` prints it)
            Path(args.out).write_text(json.dumps(results, indent=1))
    render(results, header)


def render(results: dict, header: str) -> None:
    """The markdown tables of a results dict."""
    speed, cost = results["speed"], results["cost"]
    print(header)

    print("\n## Speculative against plain decoding (oracle drafts)\n")
    print("| batch | accept | k (sized: confidence-sized, up to the largest k) | plain tok/s | spec tok/s | speedup | acceptance by position | tokens / request-step "
          "| verify tokens / step | steps spec / plain | mismatched requests | drafter ms / verify step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in speed:
        per = "/".join(f"{a:.2f}" for a in r["acceptance"]) or "-"
        print(f"| {r['batch']} | {r['accept']} | {r['k']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {per} | {r['tokens_per_request_step']:.2f} | "
              f"{r['verify_tokens_per_step']:.1f} | {r['spec_steps']} / {r['plain_steps']} | "
              f"{r['mismatched_requests']} | {r.get('draft_ms', 0.0):.3f} |")
    print("\nacceptance by position i: accepted / verified drafts at draft position i whose drafts before it were "
          "all accepted (about `accept`); tokens / request-step: accepted drafts + the target's own token")
    print("\n## Verify step cost by verified tokens per request (accept = 1.0; k = 0: the verify path, no drafts)\n")
    print("| batch | plain step ms | k | verified tokens / request | verify step ms | ms / verified token | "
          "verify step / plain step | spec tok/s | mismatched requests |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in cost:
        print(f"| {r['batch']} | {r['plain_step_ms']:.3f} | {r['k']} | {r['verified_per_request']:.2f} | "
              f"{r['step_ms']:.3f} | {r['ms_per_verified_token']:.4f} | {r['step_ms'] / r['plain_step_ms']:.2f}x | "
              f"{r['spec_tok_s']:.1f} | {r['mismatched_requests']} |")


if __name__ == "__main__":
    main()
