#!/usr/bin/env python3
"""A stand-in for a SandboxFusion server (https://github.com/bytedance/SandboxFusion) for tests:
it really runs the submitted code, without SandboxFusion's isolation. Standard library only.

    python3 scripts/fake_sandbox_fusion.py [--host 127.0.0.1] [--port 0]

`POST /run_code` takes SandboxFusion's RunCodeRequest and answers its RunCodeResponse, as
SandboxFusion's `sandbox_api.run_code` does with `isolation: none`: `python` runs
`python3 FILE` (this interpreter) with the request's stdin, `cpp` compiles with
`g++ -std=c++17` first; `run_timeout`/`compile_timeout` kill the process group
(TimeLimitExceeded); `memory_limit_MB` > 0 sets RLIMIT_AS, RLIMIT_DATA and RLIMIT_STACK; the
status is SandboxFusion's `parse_run_status` (an Error outcome is a SandboxError, a time-out or a
non-zero exit Failed, else Success). Field names and enum values come from
`core/rewards/tests/data/sandbox_fusion_schema.json` (extracted from SandboxFusion's source by
`scripts/reference/sandbox_schema.py`); a request with a missing required field, an unknown field
or an unknown language is answered 422 — stricter than SandboxFusion, which ignores unknown
fields, so that a misspelt key fails the tests.

Faults for the error-path tests: `POST /status/<code>` answers HTTP <code>; `POST /malformed`
answers 200 with a body that is not JSON; `GET /requests` answers `{path: requests received}`;
`GET /max_in_flight` answers the most `/run_code` requests it was running at once.
`--port 0` picks a free port; the server prints `listening on http://HOST:PORT` once it accepts
requests. Never expose it: it executes whatever it is sent.
"""

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SCHEMA = json.loads(
    (Path(__file__).resolve().parents[1] / "core/rewards/tests/data/sandbox_fusion_schema.json").read_text())
REQUEST_FIELDS = {f["name"]: f for f in SCHEMA["models"]["RunCodeRequest"]}
RESPONSE_FIELDS = [f["name"] for f in SCHEMA["models"]["RunCodeResponse"]]
RESULT_FIELDS = [f["name"] for f in SCHEMA["models"]["CommandRunResult"]]
FINISHED, ERROR, TLE = SCHEMA["enums"]["CommandRunStatus"]
SUCCESS, FAILED, SANDBOX_ERROR = SCHEMA["enums"]["RunStatus"]


def limits(memory_limit_mb):
    def apply():
        if memory_limit_mb > 0:
            limit = memory_limit_mb * 1024 * 1024
            for which in (resource.RLIMIT_AS, resource.RLIMIT_DATA, resource.RLIMIT_STACK):
                resource.setrlimit(which, (limit, resource.getrlimit(which)[1]))
    return apply


def run_command(argv, timeout, stdin, cwd, memory_limit_mb):
    """One command as SandboxFusion's `run_command_bare`: a CommandRunResult dict."""
    try:
        p = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True,
                             preexec_fn=limits(memory_limit_mb))
    except OSError as e:
        return {"status": ERROR, "stderr": f"exception on running command {argv}: {e}"}
    start = time.time()
    try:
        out, err = p.communicate((stdin or "").encode(), timeout=timeout)
        result = {"status": FINISHED, "execution_time": time.time() - start, "return_code": p.returncode}
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        result = {"status": TLE, "execution_time": time.time() - start}
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # Whatever the program left running.
        except ProcessLookupError:
            pass
    result["stdout"] = out.decode(errors="replace")
    result["stderr"] = err.decode(errors="replace")
    return {name: result.get(name) for name in RESULT_FIELDS}


def run_code(request):
    """SandboxFusion's `run_code`: the RunCodeResponse dict."""
    memory = request.get("memory_limit_MB", REQUEST_FIELDS["memory_limit_MB"]["default"])
    compile_timeout = request.get("compile_timeout", REQUEST_FIELDS["compile_timeout"]["default"])
    run_timeout = request.get("run_timeout", REQUEST_FIELDS["run_timeout"]["default"])
    compile_result = run_result = None
    with tempfile.TemporaryDirectory() as tmp:
        if request["language"] == "python":
            source, command = "main.py", [sys.executable, "main.py"]
        else:
            source, command = "main.cpp", ["./test"]
        Path(tmp, source).write_text(request["code"])
        if request["language"] == "cpp":
            compile_result = run_command(["g++", "-std=c++17", source, "-o", "test"], compile_timeout,
                                         None, tmp, memory)
        if compile_result is None or (compile_result["status"] == FINISHED
                                      and compile_result["return_code"] == 0):
            run_result = run_command(command, run_timeout, request.get("stdin"), tmp, memory)
    outcomes = [r for r in (compile_result, run_result) if r is not None]
    status, message = SUCCESS, ""
    errors = [r for r in outcomes if r["status"] == ERROR]
    if errors:
        status, message = SANDBOX_ERROR, errors[0]["stderr"] or ""
    elif any(r["status"] == TLE for r in outcomes) or any(
            r["return_code"] not in (None, 0) for r in outcomes):
        status = FAILED
    response = {"status": status, "message": message, "compile_result": compile_result,
                "run_result": run_result, "executor_pod_name": None, "files": {}}
    assert list(response) == RESPONSE_FIELDS, "the answer's fields drifted from the schema"
    return response


def invalid(request):
    """Why a request is not a RunCodeRequest, or None."""
    if not isinstance(request, dict):
        return "the body is not a JSON object"
    unknown = sorted(set(request) - set(REQUEST_FIELDS))
    missing = sorted(n for n, f in REQUEST_FIELDS.items() if f["required"] and n not in request)
    if unknown or missing:
        return f"unknown fields {unknown}, missing fields {missing}"
    if request["language"] not in SCHEMA["enums"]["Language"]:
        return f"unknown language {request['language']!r}"
    if request["language"] not in ("python", "cpp"):
        return f"language {request['language']!r} is not run by this fake server"
    if not isinstance(request["code"], str) or not isinstance(request.get("stdin") or "", str):
        return "code and stdin must be strings"
    return None


class Handler(BaseHTTPRequestHandler):
    counts = {}
    in_flight = [0, 0]  # now, most
    lock = threading.Lock()

    def answer(self, status, body: bytes, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path in ("/requests", "/max_in_flight"):
            with self.lock:
                body = json.dumps(self.counts if self.path == "/requests" else self.in_flight[1])
            self.answer(200, body.encode())
        else:
            self.answer(404, b'{"detail": "Not Found"}')

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.lock:
            self.counts[self.path] = self.counts.get(self.path, 0) + 1
        if self.path.startswith("/status/"):
            code = int(self.path.rsplit("/", 1)[1])
            self.answer(code, b"<html><body>fault injected</body></html>", "text/html")
            return
        if self.path == "/malformed":
            self.answer(200, b'{"status": "Success", "run_result": ')
            return
        if self.path != "/run_code":
            self.answer(404, b'{"detail": "Not Found"}')
            return
        try:
            request = json.loads(body)
        except json.JSONDecodeError as e:
            self.answer(422, json.dumps({"detail": f"invalid JSON: {e}"}).encode())
            return
        why = invalid(request)
        if why:
            self.answer(422, json.dumps({"detail": why}).encode())
            return
        with self.lock:
            self.in_flight[0] += 1
            self.in_flight[1] = max(self.in_flight)
        try:
            response = run_code(request)
        finally:
            with self.lock:
                self.in_flight[0] -= 1
        self.answer(200, json.dumps(response).encode())

    def log_message(self, *args):
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
