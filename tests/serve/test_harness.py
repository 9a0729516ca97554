"""The lm-evaluation-harness model (openk3/serve/harness.py): scores against a hand computation, generation against
the engine, and whole lm_eval runs of two local tasks over JSONL files made here (nothing is downloaded)."""

import json
import os
import tempfile

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local JSON dataset must never reach for the network
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="openk3-hf-"))

import pytest  # noqa: E402
import torch  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from openk3.serve.engine import SamplingParams  # noqa: E402
from openk3.serve.harness import OpenK3LM  # noqa: E402
from tests.serve.test_server import model_dir  # noqa: E402,F401  (the shared small model fixture)


@pytest.fixture(scope="module")
def lm(model_dir):  # noqa: F811
    return OpenK3LM(pretrained=str(model_dir), max_gen_toks=12)


def request(kind: str, args: tuple) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_loglikelihood_equals_a_hand_computation(lm):
    context, continuation = "def f(x):\n", "    return x"
    (score, greedy), = lm.loglikelihood([request("loglikelihood", (context, continuation))])
    ids = lm.tokenizer.encode(context) + lm.tokenizer.encode(continuation)
    n = len(lm.tokenizer.encode(continuation))
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(torch.tensor([ids[:-1]])).logits[0].double(), -1)
    expected = sum(float(logp[len(ids) - 1 - n + i, ids[len(ids) - n + i]]) for i in range(n))
    assert score == pytest.approx(expected, rel=1e-5, abs=1e-5) and score < 0
    assert greedy == all(int(logp[len(ids) - 1 - n + i].argmax()) == ids[len(ids) - n + i] for i in range(n))
    rolled, = lm.loglikelihood_rolling([request("loglikelihood_rolling", (context + continuation,))])
    assert rolled < score  # the whole text is less likely than its tail given its head


def test_generate_until_is_engine_greedy_cut_at_the_stop_string(lm):
    prompt = "import os\n"
    ids = lm.tokenizer.encode(prompt)
    ref = lm.engine.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0]
    full = lm.tokenizer.decode(ref.completion_ids)
    out, = lm.generate_until([request("generate_until", (prompt, {"until": [], "max_gen_toks": 12}))])
    assert out == full
    stop = full[len(full) // 2:][:2] or "\n"
    cut, = lm.generate_until([request("generate_until", (prompt, {"until": [stop], "max_gen_toks": 12}))])
    assert cut == full[:full.find(stop)] and not lm.engine.has_work()


def test_lm_eval_runs_local_tasks(lm, tmp_path):
    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": f"def f{i}(x):", "choices": ["\n    return x", " pass!!"],
                                      "answer": 0}) + "\n" for i in range(4)))
    gen = tmp_path / "gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": f"import os{i}", "target": "\n"}) + "\n" for i in range(3)))
    (tmp_path / "mc.yaml").write_text(f"""task: openk3_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (tmp_path / "gen.yaml").write_text(f"""task: openk3_local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    out = lm_eval.simple_evaluate(model=lm, tasks=["openk3_local_mc", "openk3_local_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path)))
    mc_acc = out["results"]["openk3_local_mc"]["acc,none"]
    assert 0.0 <= mc_acc <= 1.0 and "exact_match,none" in out["results"]["openk3_local_gen"]
    # the task's accuracy is our own loglikelihood ranking, recomputed here
    docs = [json.loads(line) for line in mc.read_text().splitlines()]
    right = 0
    for d in docs:
        scores = [s for s, _ in lm.loglikelihood([request("loglikelihood", (d["question"], c))
                                                  for c in d["choices"]])]
        right += int(max(range(len(scores)), key=scores.__getitem__) == d["answer"])
    assert mc_acc == pytest.approx(right / len(docs))


def test_a_continuation_without_context_is_a_clear_error(lm):
    with pytest.raises(ValueError, match="needs at least one context token"):
        lm.loglikelihood([request("loglikelihood", ("", "def f(x): return x"))])
