"""`python -m dilaserve.worker`: one instance's worker process (one rank of it under tensor
parallelism), started by a launcher."""

from __future__ import annotations

import argparse
import logging
import sys

from dilaserve.protocol import CacheMode
from dilaserve.worker.kv_cache import parse_kv_memory
from dilaserve.worker.process import WorkerSettings, serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dilaserve.worker", description=__doc__)
    p.add_argument("--endpoint", required=True, help="the engine's ZeroMQ endpoint")
    p.add_argument("--instance", type=int, required=True)
    p.add_argument("--worker-id", type=int, required=True, help="unique per process start")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--cache", choices=[m.value for m in CacheMode], default="dual")
    p.add_argument(
        "--max-requests", type=int, default=64, help="resident requests the KV pool is sized for"
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_kv_memory,
        default=None,
        help="KV pool size: bytes (8GiB) or a fraction of free device memory (0.5)",
    )
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="under the block cache, share the K/V of common prompt blocks",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the instance")
    p.add_argument("--rank", type=int, default=0, help="this process's rank in the instance")
    p.add_argument(
        "--dist-init", default=None, help="torch.distributed rendezvous (file://... or tcp://...)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s worker {args.instance}/{args.worker_id} rank {args.rank} "
        "%(levelname)s %(message)s",
    )
    return serve(
        WorkerSettings(
            endpoint=args.endpoint,
            instance=args.instance,
            worker_id=args.worker_id,
            model=args.model,
            cache=CacheMode(args.cache),
            max_requests=args.max_requests,
            kv_cache_memory=args.kv_cache_memory,
            prefix_caching=args.prefix_caching,
            dtype=args.dtype,
            device=args.device,
            threads=args.threads,
            tp=args.tp,
            rank=args.rank,
            dist_init=args.dist_init,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
