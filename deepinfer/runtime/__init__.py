"""The runtime: engine loop, scheduler, paged cache, decode graphs, requests, sampling, backend selection."""
