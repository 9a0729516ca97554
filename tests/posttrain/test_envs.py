"""Environments (rewards, tools with hidden state, snapshot / restore) and the coding sandbox's limits."""

import json
import random
import time

import pytest

from openk3.posttrain.envs import DOMAINS, SIGNS, CodingEnv, coding_tests, extract_code, make_env, make_task
from openk3.posttrain.sandbox import run_python


def call(item, n=0):
    return {"id": f"functions.count:{n}", "type": "function",
            "function": {"name": "count", "arguments": json.dumps({"item": item})}}


def test_general_reward_is_exact_answer():
    task = make_task("general", random.Random(3))
    for answer, reward in ((str(task.spec["answer"]), 1.0), (str(task.spec["answer"] + 1), 0.0), ("", 0.0)):
        env = make_env("general")
        env.reset(task)
        r = env.step({"role": "assistant", "content": f" {answer}\n"})
        assert r.done and r.reward == reward


def test_agent_tools_read_hidden_state_and_snapshot_resumes_elsewhere():
    task = make_task("agent", random.Random(4))
    a, b = task.spec["ask"]
    env = make_env("agent")
    assert env.reset(task) == [{"role": "user", "content": task.prompt}]  # the stock is only in the tool's hands
    r1 = env.step({"role": "assistant", "content": "", "tool_calls": [call(a)]})
    assert not r1.done and r1.messages == [{"role": "tool", "tool_call_id": "functions.count:0",
                                            "content": str(task.spec["stock"][a])}]
    snap = env.snapshot()
    t0 = time.perf_counter()
    for _ in range(1000):
        env.snapshot()
    assert (time.perf_counter() - t0) / 1000 < 1e-3  # cheap: a deep copy of a few dozen plain values
    final = {"role": "assistant", "content": str(task.spec["answer"])}
    bad = env.step({"role": "assistant", "content": "", "tool_calls": [call("gold", 1)]})
    assert bad.messages[0]["content"].startswith("error")
    other = make_env("agent")
    other.restore(snap)  # resumes at the snapshot: the bad call never happened there
    r2 = other.step({"role": "assistant", "content": "", "tool_calls": [call(b, 1)]})
    assert r2.messages[0]["content"] == str(task.spec["stock"][b])
    assert other.step(final).reward == 1.0
    assert env.snapshot()["turn"] == 2 and snap["turn"] == 1  # the snapshot is a copy, not a view
    with pytest.raises(ValueError, match="restored into"):
        make_env("general").restore(snap)


def test_agent_runs_out_of_turns():
    task = make_task("agent", random.Random(5))
    env = make_env("agent")
    env.reset(task)
    results = [env.step({"role": "assistant", "content": "", "tool_calls": [call("apples", i)]}) for i in range(4)]
    assert [r.done for r in results] == [False, False, False, True] and results[-1].reward == 0.0
    with pytest.raises(RuntimeError, match="not running"):
        env.step({"role": "assistant", "content": "1"})


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_domain_makes_tasks_and_envs(domain):
    task = make_task(domain, random.Random(0))
    assert task.domain == domain and make_env(domain).reset(task)[0]["content"] == task.prompt
    with pytest.raises(ValueError, match="unknown domain"):
        make_task("poetry", random.Random(0))


def test_coding_reward_runs_hidden_tests():
    task = make_task("coding", random.Random(2))
    sign = SIGNS[task.spec["op"]]
    good = f"```python\ndef f(x):\n    return x {sign} {task.spec['k']}\n```"
    assert extract_code(good).strip().startswith("def f")
    for code, reward in ((good, 1.0), ("def f(x):\n    return 0", 0.0), ("def f(x) return", 0.0)):
        env = CodingEnv()
        env.reset(task)
        assert env.step({"role": "assistant", "content": code}).reward == reward, code


TESTS = "assert f(1) == 4\n"


def test_sandbox_kills_a_loop_and_scores_zero():
    r = run_python("def f(x):\n    while True:\n        pass", TESTS, time_limit=1.0)
    assert not r.passed and r.status == "timeout" and r.wall_s < 5
    r = run_python("import time\ntime.sleep(60)", TESTS, time_limit=0.5)  # no CPU used: the wall clock kills it
    assert not r.passed and r.status == "timeout" and r.wall_s < 5
    task = make_task("coding", random.Random(2))
    env = CodingEnv(time_limit=0.5)
    env.reset(task)
    assert env.step({"role": "assistant", "content": "while True:\n    pass"}).reward == 0.0


def test_sandbox_stops_unbounded_allocation():
    r = run_python("a = []\nwhile True:\n    a.append(bytearray(10**7))", TESTS, memory_mb=128)
    assert not r.passed and r.status in ("memory", "error")
    r = run_python("x = bytearray(10**11)", TESTS, memory_mb=128)
    assert not r.passed and r.status in ("memory", "error")
    env = CodingEnv(memory_mb=128)
    env.reset(make_task("coding", random.Random(2)))
    result = env.step({"role": "assistant", "content": "a = []\nwhile True:\n    a.append(' ' * 10**7)"})
    assert result.reward == 0.0 and result.info["status"] in ("memory", "error")


def test_nothing_escapes_the_sandbox(tmp_path):
    outside = tmp_path / "escaped.txt"
    attempts = [f"open({str(outside)!r}, 'w').write('x')",
                "open('../escaped.txt', 'w').write('x')",
                f"import os\nos.system('touch {outside}')",
                f"import subprocess\nsubprocess.run(['touch', {str(outside)!r}])",
                f"import os\nos.rename('solution.py', {str(outside)!r})",
                f"import shutil\nshutil.copyfile('solution.py', {str(outside)!r})",
                "import os\nos.fork()",
                f"import os\nos.chdir({str(tmp_path)!r})\nopen('escaped.txt', 'w')",
                f"try:\n    open({str(outside)!r}, 'w')\nexcept BaseException:\n    pass\ndef f(x):\n    return x + 3",
                "import socket\nsocket.create_connection(('127.0.0.1', 9))",
                # the hook's own state and helpers cannot be changed from inside
                f"import __main__\n__main__.root = {str(tmp_path)!r}\nopen({str(outside)!r}, 'w')",
                f"import os.path\nos.path.realpath = lambda p: os.getcwd()\nopen({str(outside)!r}, 'w')",
                f"import posixpath\nposixpath._joinrealpath = lambda *a: (os.getcwd(), True)\n"
                f"import os\nopen({str(outside)!r}, 'w')",
                f"import builtins\nbuiltins.isinstance = lambda *a: False\nopen({str(outside)!r}, 'w')",
                "import gc\ngc.get_objects()",
                # a descriptor of a directory outside would let *at calls write there
                f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
                "os.open('escaped.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
                "import _posixsubprocess"]
    for code in attempts:
        r = run_python(code, TESTS)
        assert r.status == "blocked" and not r.passed, (code, r)
    assert list(tmp_path.iterdir()) == []
    ok = run_python("open('scratch.txt', 'w').write('x')\ndef f(x):\n    return x + 3", TESTS)
    assert ok.passed  # writing inside its own directory is fine


def test_a_solution_cannot_fake_a_pass():
    tests = coding_tests({"op": "plus", "k": 3})
    for cheat in ("import os\nos._exit(0)",  # exit status 0 before the tests run
                  "class Yes(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Yes()",
                  "def f(x):\n    return 0\ntype = lambda v: int",  # shadowing the builtins the tests use
                  "import builtins\nbuiltins.exec = lambda *a: None",
                  "import sys\nsys.stdout.write('0' * 32)\nsys.stdout.flush()\nimport os\nos._exit(0)"):
        r = run_python(cheat, tests)
        assert not r.passed and r.status == "failed", (cheat, r)
    assert run_python("open('/proc/self/mem', 'rb')", tests).status == "blocked"  # the nonce is in there
    # ordinary code still runs: re (enum) and namedtuple read frames, dataclasses builds classes
    ok = ("import re, json, math, dataclasses\nfrom collections import namedtuple\nP = namedtuple('P', 'a')\n"
          "@dataclasses.dataclass\nclass A:\n    k: int = 3\ndef f(x):\n    return x + A().k")
    assert run_python(ok, tests).passed


def test_sandbox_bounds_endless_output():
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    r = run_python("import sys\nwhile True:\n    sys.stderr.write('x' * 10**6)", TESTS, time_limit=1.0, file_mb=1)
    assert not r.passed and len(r.stderr) <= 2000
    # its stderr is a size-limited file, not a pipe the parent holds whole (gigabytes in a second)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 << 10


def test_sandbox_rejects_bad_limits():
    with pytest.raises(ValueError, match="time_limit"):
        run_python("", "", time_limit=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("", "", memory_mb=8)


def test_coding_tests_follow_the_spec():
    assert coding_tests({"op": "times", "k": 3}).splitlines()[1] == "assert type(f(1)) is int and f(1) == 3"
