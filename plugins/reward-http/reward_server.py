#!/usr/bin/env python3
"""Serves a Python reward function to verl-core's `http` reward plugin (standard library only).

    python3 reward_server.py REWARD.py [--name compute_score] [--host 127.0.0.1] [--port 8000]

REWARD.py defines the function as verl's `custom_reward_function` does:
`compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)` returning a
number or a dict with `score` (and any extra keys, e.g. `acc`). Point verl-core at it with
`custom_reward_function.path=http://127.0.0.1:8000`. Each POST carries
`{"name", "kwargs", "items": [{"data_source", "solution_str", "ground_truth", "extra_info"}, ...]}`
and is answered with `{"scores": [...]}`, one per item in order; an exception is answered with
HTTP 500 and `{"error": "<item index>: <exception>"}`. `--port 0` picks a free port; the server
prints `listening on http://HOST:PORT` once it accepts requests.
"""

import argparse
import importlib.util
import json
import math
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        sys.exit(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain(value):
    """A result as JSON: numbers, bools, strings, lists and dicts; numpy scalars via .item()."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"score {value} is not finite")
    return value


def make_handler(module, default_name):
    class Handler(BaseHTTPRequestHandler):
        def answer(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                name = request.get("name") or default_name
                function = getattr(module, name, None)
                if not callable(function):
                    return self.answer(400, {"error": f"no function `{name}` in {module.__file__}"})
                kwargs = request.get("kwargs") or {}
            except Exception as e:  # a malformed request
                return self.answer(400, {"error": f"bad request: {e}"})
            scores = []
            for i, item in enumerate(request.get("items", [])):
                try:
                    scores.append(plain(function(
                        data_source=item.get("data_source"),
                        solution_str=item.get("solution_str"),
                        ground_truth=item.get("ground_truth"),
                        extra_info=item.get("extra_info"),
                        **kwargs,
                    )))
                except Exception as e:
                    return self.answer(500, {"error": f"item {i}: {type(e).__name__}: {e}"})
            self.answer(200, {"scores": scores})

        def log_message(self, format, *args):  # quiet: one line per request is noise in training
            pass

    return Handler


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reward_file", type=Path)
    parser.add_argument("--name", default="compute_score")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    module = load_module(args.reward_file)
    if not callable(getattr(module, args.name, None)):
        sys.exit(f"{args.reward_file}: no function `{args.name}`")
    server = ThreadingHTTPServer((args.host, args.port), make_handler(module, args.name))
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
