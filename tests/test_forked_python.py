"""The fork server's children behave as new interpreters for what the suite's tests read from them
(tests/forked_python.py): arguments, environment, working directory, import path, streams, exit status, timeout;
torchrun's agent and workers too."""

import os
import subprocess
import sys

import forked_python
import pytest
from subprocess_env import child_env

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("FORKED_PROBE"),
                  "path0": sys.path[0], "on_path": "/nowhere/extra" in sys.path, "stdin": sys.stdin.read(),
                  "main": __name__, "torch": "torch" in sys.modules, "dynamo": "torch._dynamo" in sys.modules}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[-1]))
"""


def forked(*args, **kwargs) -> subprocess.CompletedProcess:
    return forked_python.run(pytest.fail, [sys.executable, *args], **kwargs)  # pytest.fail: never a real run


@pytest.mark.parametrize("code", [0, 3])
def test_a_script_child_sees_its_own_arguments_environment_folder_path_and_stdin(tmp_path, code):
    import json

    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = child_env({"FORKED_PROBE": "yes"}, path=("/nowhere/extra",))
    done = forked(str(script), "a b", str(code), env=env, cwd=tmp_path, capture_output=True, text=True,
                  input="fed", timeout=60)
    assert done.returncode == code, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"argv": [str(script), "a b", str(code)], "cwd": str(tmp_path), "env": "yes",
                    "path0": str(tmp_path), "on_path": True, "stdin": "fed", "main": "__main__", "torch": True,
                    "dynamo": False}
    assert done.stderr == "to stderr\n"


def test_c_code_and_m_modules_run_as_main_and_an_uncaught_error_exits_1_with_its_traceback(tmp_path):
    done = forked("-c", "import sys; print(__name__, sys.argv); raise ValueError('boom')", "x", env=child_env(),
                  capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "__main__ ['-c', 'x']\n"
    assert done.stderr.rstrip().endswith("ValueError: boom") and "Traceback" in done.stderr
    (tmp_path / "probe_module.py").write_text("import sys; print(__name__, sys.argv[1:])")
    done = forked("-m", "probe_module", "y", env=child_env(path=(str(tmp_path),)), capture_output=True, text=True,
                  timeout=60)
    assert (done.returncode, done.stdout) == (0, "__main__ ['y']\n"), done.stderr


def test_atexit_handlers_run_and_a_timeout_kills_the_child(tmp_path):
    done = forked("-c", "import atexit; atexit.register(print, 'bye')", env=child_env(), capture_output=True,
                  text=True, timeout=60)
    assert done.stdout == "bye\n"
    with pytest.raises(subprocess.TimeoutExpired):
        forked("-c", "import time; time.sleep(60)", env=child_env(), capture_output=True, timeout=1)
    done = forked("-c", "print('served after a timeout')", env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.stdout == "served after a timeout\n"


def test_what_it_cannot_serve_goes_to_a_real_interpreter():
    real = []

    def real_run(args, **kwargs):
        real.append(args)
        return "real"

    for args, kwargs in [
        ([sys.executable, "-X", "importtime", "-c", "pass"], {"capture_output": True}),  # interpreter options
        ([sys.executable, "-c", "pass"], {}),  # output not captured
        (["ls"], {"capture_output": True}),  # not Python
    ]:
        assert forked_python.run(real_run, args, **kwargs) == "real"
    assert len(real) == 3


WORKER = """
import json, os, sys
forked = "torch" in sys.modules  # a new interpreter has not imported torch yet
import torch.distributed as dist
dist.init_process_group("gloo")
gathered = [None, None]
dist.all_gather_object(gathered, os.environ["LOCAL_RANK"])
elastic = any(m.startswith("torch.distributed.elastic") for m in sys.modules)
print(json.dumps({"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "gathered": gathered,
                  "argv": sys.argv[1:], "forked": forked, "parent": os.getppid(),
                  "session": os.getsid(0) == os.getpid(), "unbuffered": sys.stdout.line_buffering,
                  "elastic": elastic}))
dist.destroy_process_group()
sys.exit(int(os.environ["RANK"]) * int(sys.argv[-1]))
"""


@pytest.mark.parametrize("code", [0, 5])
def test_torchrun_and_its_workers_are_forked_and_behave_as_torchrun_s(tmp_path, code):
    import json

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    done = forked("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), "x",
                  str(code), env=child_env({"OMP_NUM_THREADS": "1"}), cwd=tmp_path, capture_output=True, text=True,
                  timeout=120)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(line["rank"] for line in lines) == ["0", "1"], done.stdout + done.stderr
    for line in lines:  # a rendezvous, a collective, the agent's children in sessions of their own, `python -u`
        assert line["world"] == "2" and line["gathered"] == ["0", "1"] and line["argv"] == ["x", str(code)]
        assert line["forked"] and line["session"] and line["unbuffered"] and not line["elastic"]
    assert lines[0]["parent"] == lines[1]["parent"] != os.getpid()
    if code:  # a worker's failure is torchrun's: its exit status and its report naming the rank
        assert done.returncode == 1 and "ChildFailedError" in done.stderr and "exitcode  : 5" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
