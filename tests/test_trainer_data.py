"""Data: gsm8k preprocessing to verl's schema, the digit task, the dataset reader, rewards."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("pyarrow")
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from hpc_verl.data.preprocess import SAMPLE_GSM8K  # noqa: E402
from hpc_verl.errors import DataError  # noqa: E402
from trainer_fixtures import digits_data, tiny_model  # noqa: E402,F401


def test_preprocess_gsm8k_sample_to_verl_schema(cli, tmp_path):
    res = cli("preprocess", "gsm8k", "--input", str(SAMPLE_GSM8K), "--output", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    train = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert len(train) + len(test) == sum(1 for _ in open(SAMPLE_GSM8K)) and len(test) >= 1
    row = train[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["prompt"][0]["role"] == "user" and '"####"' in row["prompt"][0]["content"]
    # ground truth = the number after #### in the original answer
    assert row["reward_model"]["ground_truth"] == row["extra_info"]["answer"].split("####")[-1].strip()
    assert row["extra_info"]["split"] == "train"
    # second run with --skip-existing leaves the files alone
    mtime = (tmp_path / "out" / "train.parquet").stat().st_mtime_ns
    res = cli("preprocess", "gsm8k", "--input", str(SAMPLE_GSM8K), "--output", str(tmp_path / "out"), "--skip-existing")
    assert res.returncode == 0 and "skipped" in res.stdout
    assert (tmp_path / "out" / "train.parquet").stat().st_mtime_ns == mtime


def test_preprocess_gsm8k_parquet_input_and_separate_test(tmp_path):
    from hpc_verl.data.preprocess import preprocess_gsm8k
    rows = [{"question": f"What is {i} + 1,000?", "answer": f"{i} + 1000 = {i + 1000}\n#### {i + 1000:,}"}
            for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    r = preprocess_gsm8k(tmp_path / "train.parquet", tmp_path / "o", test_input=tmp_path / "test.jsonl")
    assert (r["n_train"], r["n_test"]) == (5, 2)
    got = pq.read_table(tmp_path / "o" / "train.parquet").to_pylist()
    assert got[3]["reward_model"]["ground_truth"] == "1003"  # thousands separator removed


@pytest.mark.parametrize("content,needle", [
    ('{"question": "q", "answer": "no final"}\n', "no '#### <number>' final answer"),
    ('{"question": "q"}\n', "missing text field(s) answer"),
    ('{"question": "q", "answer": "#### 1"}\nnot json\n', "line 2: not valid JSON"),
    ('[1, 2]\n', "expected a JSON object"),
])
def test_bad_data_file_is_one_line_and_writes_nothing(cli, tmp_path, content, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    res = cli("preprocess", "gsm8k", "--input", str(bad), "--output", str(tmp_path / "out"))
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "out" / "train.parquet").exists()


def test_job_stage_and_verb_share_options_and_defaults(cli, tmp_path):
    """`python -m hpc_verl.data.preprocess` (the job's stage) and `hpc-verl preprocess` take the same
    options with the same defaults (the functions' own): the same rows come out."""
    import subprocess
    import sys

    stage = subprocess.run([sys.executable, "-m", "hpc_verl.data.preprocess", "--dataset", "digits", "--output",
                            str(tmp_path / "a"), "--n-train", "12", "--n-digits", "4"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert stage.returncode == 0, stage.stderr
    verb = cli("preprocess", "digits", "--output", str(tmp_path / "b"), "--n-train", "12", "--n-digits", "4")
    assert verb.returncode == 0, verb.stderr
    assert stage.stdout.replace("/a/", "/b/") == verb.stdout and "(12 rows)" in verb.stdout
    a, b = (pq.read_table(tmp_path / d / "train.parquet").to_pylist() for d in "ab")
    assert len(a) == 12 and a == b
    res = subprocess.run([sys.executable, "-m", "hpc_verl.data.preprocess", "--output", str(tmp_path / "c")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2 and "--input FILE is required" in res.stderr


def test_unknown_format_and_damaged_parquet(tmp_path):
    from hpc_verl.data.preprocess import read_records
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown format"):
        read_records(tmp_path / "x.csv")
    (tmp_path / "x.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(DataError, match="not a readable parquet"):
        read_records(tmp_path / "x.parquet")


def test_digit_task_rows():
    from hpc_verl.data.preprocess import digit_rows
    rows = digit_rows(20, seed=3, split="train")
    assert all(r["reward_model"]["ground_truth"] == r["prompt"][0]["content"][:3] for r in rows)
    assert len({r["prompt"][0]["content"] for r in rows}) > 15
    assert digit_rows(5, 3, "train") == digit_rows(5, 3, "train")  # seeded


def test_dataset_applies_chat_template_and_handles_overlong(tiny_model, digits_data, tmp_path):
    from transformers import AutoTokenizer

    from hpc_verl.data.dataset import RLDataset
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ds = RLDataset(str(digits_data / "train.parquet"), tok, max_prompt_length=16)
    s = ds.samples[0]
    text = tok.decode(s.prompt_ids)
    assert text.startswith("<|user|>") and text.endswith("<|assistant|>")  # chat template applied
    assert s.ground_truth == s.raw_prompt[0]["content"][:3]
    # 8 tokens per prompt: a limit of 6 refuses, filters, or truncates as configured
    with pytest.raises(DataError, match="over data.max_prompt_length=6"):
        RLDataset(str(digits_data / "train.parquet"), tok, max_prompt_length=6)
    mixed = [{"data_source": "x", "prompt": [{"role": "user", "content": c}]} for c in ("1", "1234567890")]
    pq.write_table(pa.Table.from_pylist(mixed), tmp_path / "m.parquet")
    ds = RLDataset(str(tmp_path / "m.parquet"), tok, max_prompt_length=6, filter_overlong_prompts=True)
    assert len(ds) == 1 and ds.n_filtered == 1
    ds = RLDataset(str(tmp_path / "m.parquet"), tok, max_prompt_length=6, truncation="left")
    assert len(ds.samples[1].prompt_ids) == 6 and tok.decode(ds.samples[1].prompt_ids).endswith("<|assistant|>")
    # no chat template: contents are used as they are
    tok.chat_template = None
    ds = RLDataset(str(digits_data / "train.parquet"), tok, max_prompt_length=16)
    assert tok.decode(ds.samples[0].prompt_ids) == ds.samples[0].raw_prompt[0]["content"]
    # a rule-based reward needs every row's ground truth (else reward 0 every step, silently)
    with pytest.raises(DataError, match=r"m.parquet: 2 of 2 rows have no reward_model.ground_truth \(no "
                                        r"reward_model column\).*score every response of them 0"):
        RLDataset(str(tmp_path / "m.parquet"), tok, max_prompt_length=16, require_ground_truth=True)
    assert len(RLDataset(str(digits_data / "train.parquet"), tok, 16, require_ground_truth=True)) == 256
    pq.write_table(pa.Table.from_pylist([{"prompt": "x"}]), tmp_path / "noschema.parquet")
    with pytest.raises(DataError, match="missing column"):
        RLDataset(str(tmp_path / "noschema.parquet"), tok, 16)


def test_resumable_sampler_position():
    from hpc_verl.data.dataset import ResumableSampler
    a = ResumableSampler(10, 3, seed=5)
    seq = [a.next_batch() for _ in range(7)]  # 3 batches per epoch, crosses two epochs
    assert sorted(sum(seq[:3], [])) != list(range(10)) or True
    assert len(set(sum(seq[:3], []))) == 9  # no repeats within an epoch
    b = ResumableSampler(10, 3, seed=5)
    for _ in range(4):
        b.next_batch()
    state = b.state_dict()
    c = ResumableSampler(10, 3, seed=5)
    c.load_state_dict(state)
    assert [c.next_batch() for _ in range(3)] == seq[4:7]
    with pytest.raises(DataError, match="resume with the same data"):
        ResumableSampler(11, 3, seed=5).load_state_dict(state)


def test_rule_rewards():
    from hpc_verl.trainer.roles.reward_rules import RuleReward, digits_score, gsm8k_score
    assert gsm8k_score("openai/gsm8k", "so 3+4=7 #### 7", "7") == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 1,234", "1234") == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 8", "7") == 0.0
    assert gsm8k_score("openai/gsm8k", "the answer is 7", "7") == 0.0
    assert digits_score("hpc_verl/digits", "123", "123") == 1.0
    assert digits_score("hpc_verl/digits", "1x3", "123") == pytest.approx(2 / 3)
    assert digits_score("hpc_verl/digits", "", "123") == 0.0
    with pytest.raises(DataError, match="no reward function for data_source 'nope'"):
        RuleReward().score("nope", "x", "y")


def test_preprocess_module_entry_for_the_launcher(tmp_path, capsys):
    from hpc_verl.data.preprocess import main
    assert main(["--input", str(SAMPLE_GSM8K), "--output", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "train.parquet").is_file()
    assert main(["--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not found" in err[0]
    assert main(["--dataset", "digits", "--output", str(tmp_path / "d"), "--n-train", "20", "--n-test", "4"]) == 0
    assert pq.read_table(tmp_path / "d" / "train.parquet").num_rows == 20


def test_plot_and_summary_from_metrics(cli, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": i, "critic/score/mean": i / 10, "actor/ppo_kl": 0.01 * i, "actor/pg_loss": -0.1 * i,
             "perf/tokens_per_s": 100.0 + i, "timing_s/step": 0.2} for i in range(1, 11)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = cli("plot", str(run))
    assert res.returncode == 0, res.stderr
    png = run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    res = cli("plot", str(tmp_path / "nothing"))
    assert res.returncode == 2 and "metrics.jsonl" in res.stderr and "Traceback" not in res.stderr
    import io

    from hpc_verl.trainer.observe.metrics import summary_table
    buf = io.StringIO()
    summary_table(rows, run, file=buf)
    text = buf.getvalue()
    assert "critic/score/mean" in text and "0.1" in text and "1" in text
