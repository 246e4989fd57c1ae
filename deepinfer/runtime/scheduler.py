"""Continuous batching over the paged cache.

Each step is either a prefill step (the next chunks of the requests still reading their prompt, several
requests in one forward, under a token budget) or a decode step (one token for every running request). When
blocks run out, the most recently admitted request is preempted: its slot and blocks are freed and it goes
back to the front of the queue, to be recomputed (prefilled again over its prompt and the tokens it generated)
when it is admitted again. No request is dropped.

With a prefix cache, a request starts on its longest cached prefix when its first prefill chunk is scheduled
(`SlotBlocks.start`): its prefill resumes there (or, in approximate mode, a few tokens before it to rebuild the
sliding window), and the blocks it shares count toward admission as blocks it does not need.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deepinfer.runtime.blocks import SlotBlocks
from deepinfer.runtime.defaults import MAX_PREFILL_TOKENS
from deepinfer.errors import ConfigError
from deepinfer.runtime.request import Request


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests running at once (also the largest decode batch)
    max_prefill_tokens: int = MAX_PREFILL_TOKENS  # prompt tokens per prefill step
    async_scheduling: bool = True  # prepare the next decode step while the device runs this one

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")


@dataclass(frozen=True)
class PrefillStep:
    chunks: tuple[tuple[Request, int], ...]  # (request, tokens this step)


@dataclass(frozen=True)
class DecodeStep:
    requests: tuple[Request, ...]


class Scheduler:
    def __init__(self, cache: SlotBlocks, config: SchedulerConfig, max_len: int):
        self.cache, self.config, self.max_len = cache, config, max_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def add(self, req: Request) -> None:
        need = min(len(req.prompt_ids) + req.params.max_new_tokens, self.max_len)
        self.cache.check_fits(need, f"request {req.index}")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request) -> None:
        self.retire(req)
        self.release(req)

    def retire(self, req: Request) -> None:
        """A finished request leaves the running set; its cache stays held until `release` (a step in flight may
        still read and write it)."""
        self.running.remove(req)

    def release(self, req: Request) -> None:
        self.cache.release(req.cache)
        req.cache = None

    def decode_ahead(self, requests: list[Request]) -> DecodeStep | None:
        """The decode step after the one in flight, scheduled before the host has seen that step's tokens: these
        requests (running, decoding) one position further. None where `next_step` could do anything else (admit a
        waiting request, run a prefill, preempt for blocks): the caller waits for the flight and schedules then."""
        if self.waiting and len(requests) < self.config.max_num_seqs and self._admits_after(requests):
            return None
        if any(r.in_prefill for r in self.running):
            return None
        # the step feeds each request's in-flight token at position num_tokens (its host count lags by one)
        need = sum(max(0, self.cache.blocks_for(r.num_tokens + 1) - len(r.cache.blocks)) for r in requests)
        if need > self.cache.free_blocks:
            return None
        for r in requests:
            if not self.cache.grow(r.cache, r.num_tokens + 1):
                raise AssertionError(f"request {r.index} cannot hold {r.num_tokens + 1} positions")
        return DecodeStep(tuple(requests))

    def next_step(self) -> PrefillStep | DecodeStep:
        self._admit()
        prefill = self._prefill_step()
        if prefill is not None:
            return prefill
        decoding = [r for r in self.running if not r.in_prefill]
        for r in list(decoding):
            if r not in self.running:
                continue  # preempted while making room for an earlier request
            while not self.cache.grow(r.cache, r.num_tokens):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is r:
                    break
        step = tuple(r for r in decoding if r in self.running)
        for r in step:
            self._room_for_drafts(r)
        return DecodeStep(step)

    def _room_for_drafts(self, req: Request) -> None:
        """Speculative decoding: the request's drafts cut to the positions its length limits leave and its blocks
        hold, growing them only from blocks nobody holds (drafts never preempt a request or evict a cached
        prefix)."""
        room = min(req.params.max_new_tokens - len(req.generated), self.max_len - req.num_tokens) - 1
        drafts = req.drafts[: max(room, 0)]
        want = self.cache.blocks_for(req.num_tokens + len(drafts)) - len(req.cache.blocks)
        if drafts and 0 < want <= self.cache.unused_blocks:
            self.cache.grow(req.cache, req.num_tokens + len(drafts))
        held = len(req.cache.blocks) * self.cache.spec.block_tokens
        req.drafts = drafts[: max(held - req.num_tokens, 0)]

    def _admits_after(self, requests: list[Request]) -> bool:
        """Whether `next_step` would admit the first waiting request once the running requests not in `requests`
        (those ending on the tokens in flight) have left, as `_admit` decides."""
        ending = [r for r in self.running if not any(r is c for c in requests)]
        free = self.cache.free_blocks + sum(len(r.cache.blocks) for r in ending)
        head = self.waiting[0]
        return not requests or self.cache.blocks_needed(head.num_prefill + 1, self._lookup(head)) <= free

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            # admit only what can prefill in full (or anything, when nothing runs: `add` checked it fits);
            # else it would take blocks, stall and be preempted again at once
            head = self.waiting[0]
            if self.running and (self.cache.blocks_needed(head.num_prefill + 1, self._lookup(head))
                                 > self.cache.free_blocks):  # the cached prefix it could start on now counts
                return
            seq = self.cache.admit()
            if seq is None:
                return
            req = self.waiting.popleft()
            req.cache = seq
            self.running.append(req)

    def _begin(self, req: Request) -> None:
        """A request's first prefill chunk is about to be scheduled: put it on its longest cached prefix now (not at
        admission: requests admitted together then find the blocks an earlier one has prefilled meanwhile)."""
        hit = self._lookup(req)
        self.cache.start(req.cache, hit, req.prefill_ids)
        req.cache.begun = True
        if req.num_cached_tokens is None:  # reported as the request's cached tokens: its first run's hit
            req.num_cached_tokens = hit.tokens
            req.output.start(hit.tokens)

    def _lookup(self, req: Request):
        """The request's longest cached prefix now; its block names are hashed once per prefill length."""
        if self.cache.prefix is None:
            return self.cache.lookup([])
        if req.block_names is None or req.block_names[0] != req.num_prefill:
            req.block_names = (req.num_prefill, self.cache.names_of(req.prefill_ids))
        return self.cache.lookup(req.block_names[1])

    def _prefill_step(self) -> PrefillStep | None:
        budget, chunks = self.config.max_prefill_tokens, []
        for r in [r for r in self.running if r.in_prefill]:
            if budget == 0:
                break
            if not r.cache.begun:
                self._begin(r)
            take = min(r.num_prefill - r.cached, budget)
            room = (len(r.cache.blocks) + self.cache.free_blocks) * self.cache.spec.block_tokens - r.cached
            take = min(take, room)
            if take <= 0:
                continue
            self.cache.grow(r.cache, r.cached + take)
            chunks.append((r, take))
            budget -= take
        if chunks:
            return PrefillStep(tuple(chunks))
        stuck = [r for r in self.running if r.in_prefill]
        if stuck and len(self.running) > 1:  # prompts that cannot advance: free the newest request's blocks
            self.preempt(self.running[-1])
            return self._prefill_step()
        return None

    def preempt(self, req: Request) -> None:
        # work to recompute (a request evicted before its first prefill chunk ran loses nothing)
        lost = req.cache.num_tokens > req.cache.resume
        self.cache.release(req.cache)
        req.cache = None
        self.running.remove(req)
        self.waiting.appendleft(req)
        req.preemptions += lost
        self.preemptions += lost
