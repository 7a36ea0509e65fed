"""CLI: ``python -m hopperjax.serve --artifact DIR [--host H] [--port P] [--max-batch B]
[--max-wait-ms T] [--max-queue Q]``.

Serves an artifact of ``python -m hopperjax.export`` over HTTP (``hopperjax/infer/serve.py``):
``POST /predict`` with ``{"inputs": {field: values}}``, ``GET /health``, ``GET /metrics``;
requests are batched dynamically up to ``--max-batch`` examples, waiting at most
``--max-wait-ms`` for company, padded to power-of-two buckets. Needs ``pip install
'hopperjax[serve]'`` (Starlette, uvicorn). Errors (no artifact, a missing extra): one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hopperjax.serve", description=__doc__)
    parser.add_argument("--artifact", required=True, help="a hopperjax.export directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=32, help="examples per batch")
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--max-queue", type=int, default=256, help="requests waiting (then 503)")
    args = parser.parse_args(argv)
    try:
        import uvicorn
    except ImportError as e:
        print(f"hopperjax.serve: {e.name} is missing: pip install 'hopperjax[serve]'",
              file=sys.stderr)  # fmt: skip
        return 2
    from hopperjax.infer import artifact
    from hopperjax.infer.serve import build_app

    try:
        model = artifact.load(args.artifact)
        app = build_app(model, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                        max_queue=args.max_queue)  # fmt: skip
    except (artifact.ArtifactError, ValueError) as e:
        print(f"hopperjax.serve: --artifact {args.artifact}: {e}", file=sys.stderr)
        return 2
    print(f"hopperjax.serve: the '{model.metadata['workload']}' model of step "
          f"{model.metadata['step']} (INT8 {model.metadata['quantize']}) on "
          f"http://{args.host}:{args.port}/predict", flush=True)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
