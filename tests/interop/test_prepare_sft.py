"""launch/scripts/prepare_sft.py against the tokenizer it is given, offline.

A small byte-level BPE tokenizer is trained with the `tokenizers` library and
saved as a PreTrainedTokenizerFast with a chat template and an EOS token in a
temporary model directory. On a few chats:
  * the ids of every sample are what apply_chat_template gives (plus the EOS
    token when the template does not end with it), the prompt tokens are
    labelled -100 and the assistant turns (their text and the end-of-turn
    marker) are trained; trailing user turns are left out, a chat without an
    assistant turn is skipped;
  * templates with {% generation %} blocks give the same samples; a template
    that renders the last assistant turn differently gives one sample per turn;
  * bad JSON, missing messages, a directory without a tokenizer or without a
    chat template stop with a non-zero exit naming the file and line;
  * `moefit train` and `moefit eval` run on the output (data.format jsonl).
"""
import json
import os
import pathlib
import subprocess
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "scripts" / "prepare_sft.py"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("you are a helpful assistant. what is two plus two? it is four. and three plus three? "
         "six. tell me a joke. no. hello there, how are you? fine, thanks. system user assistant")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same rendering, with the assistant turns marked for transformers' assistant mask.
CHATML_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Like Qwen3's: the last assistant turn renders differently from earlier ones.
LAST_TURN_MARKED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Turns end with the EOS token itself, the last one with no newline after it.
ENDS_WITH_EOS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
                 "{% if not loop.last %}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}")

CHATS = [
    {"messages": [{"role": "system", "content": "you are a helpful assistant."},
                  {"role": "user", "content": "what is two plus two?"},
                  {"role": "assistant", "content": "it is four."}]},
    {"messages": [{"role": "user", "content": "hello there, how are you?"},
                  {"role": "assistant", "content": "fine, thanks."},
                  {"role": "user", "content": "and three plus three?"},
                  {"role": "assistant", "content": "six."}]},
    {"messages": [{"role": "user", "content": "tell me a joke."},
                  {"role": "assistant", "content": "no."},
                  {"role": "user", "content": "what is two plus two?"}]},
    {"messages": [{"role": "user", "content": "hello there"}]},  # nothing to train: skipped
]


def make_model_dir(path, template, eos="<|endoftext|>"):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([WORDS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(path)
    return path


def write_chats(path, chats):
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return path


def prepare(model_dir, data, out):
    return subprocess.run([sys.executable, str(SCRIPT), str(model_dir), str(data), str(out)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))


def read_samples(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def chat_ids(tok, messages):
    out = tok.apply_chat_template(messages)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def trained_text(tok, sample):
    return tok.decode([t for t in sample["labels"] if t != -100], skip_special_tokens=False)


def check_labels(sample):
    ids, labels = sample["input_ids"], sample["labels"]
    assert len(ids) == len(labels)
    assert all(l in (-100, t) for t, l in zip(ids, labels))
    assert labels[0] == -100


def test_prompt_tokens_masked_assistant_trained(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", CHATML)
    out = tmp_path / "out.jsonl"
    run = prepare(model_dir, write_chats(tmp_path / "chats.jsonl", CHATS), out)
    assert run.returncode == 0, run.stderr
    assert "1 without an assistant turn" in run.stderr
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    eos = tok.eos_token_id
    samples = read_samples(out)
    assert len(samples) == 3
    # Chat 3's trailing user turn trains nothing and is left out.
    kept = [CHATS[0]["messages"], CHATS[1]["messages"], CHATS[2]["messages"][:2]]
    for sample, messages in zip(samples, kept):
        check_labels(sample)
        assert sample["input_ids"] == chat_ids(tok, messages) + [eos]
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        want = "".join(a + "<|im_end|>\n" for a in answers) + "<|endoftext|>"
        assert trained_text(tok, sample) == want
        prompt = [t for t, l in zip(sample["input_ids"], sample["labels"]) if l == -100]
        assert "assistant" in tok.decode(prompt) and messages[0]["content"] in tok.decode(prompt)

    # {% generation %} blocks around the same spans give the same samples.
    gen_dir = make_model_dir(tmp_path / "gen", CHATML_GENERATION)
    gen_out = tmp_path / "gen.jsonl"
    run = prepare(gen_dir, tmp_path / "chats.jsonl", gen_out)
    assert run.returncode == 0, run.stderr
    assert read_samples(gen_out) == samples


def test_template_rendering_turns_differently_gives_one_sample_per_turn(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", LAST_TURN_MARKED)
    out = tmp_path / "out.jsonl"
    run = prepare(model_dir, write_chats(tmp_path / "chats.jsonl", [CHATS[1]]), out)
    assert run.returncode == 0, run.stderr
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    samples = read_samples(out)
    messages = CHATS[1]["messages"]
    assert len(samples) == 2
    for sample, upto, answer in [(samples[0], 2, "fine, thanks."), (samples[1], 4, "six.")]:
        check_labels(sample)
        assert sample["input_ids"] == chat_ids(tok, messages[:upto]) + [tok.eos_token_id]
        assert trained_text(tok, sample) == f"<think></think>{answer}<|im_end|>\n<|endoftext|>"


def test_no_eos_appended_when_the_template_ends_with_it(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", ENDS_WITH_EOS, eos="<|im_end|>")
    out = tmp_path / "out.jsonl"
    run = prepare(model_dir, write_chats(tmp_path / "chats.jsonl", [CHATS[0]]), out)
    assert run.returncode == 0, run.stderr
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    [sample] = read_samples(out)
    assert sample["input_ids"] == chat_ids(tok, CHATS[0]["messages"])
    assert sample["input_ids"][-1] == tok.eos_token_id
    assert trained_text(tok, sample) == "it is four.<|im_end|>"


def test_errors_name_file_and_line(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", CHATML)
    out = tmp_path / "out.jsonl"
    bad_json = tmp_path / "bad_json.jsonl"
    bad_json.write_text(json.dumps(CHATS[0]) + "\n" + '{"messages": [\n')
    no_messages = tmp_path / "no_messages.jsonl"
    no_messages.write_text('{"conversation": []}\n')
    no_role = tmp_path / "no_role.jsonl"
    no_role.write_text('\n{"messages": [{"content": "hi"}]}\n')
    for data, expected in [(bad_json, "bad_json.jsonl:2: not valid JSON"),
                           (no_messages, 'no_messages.jsonl:1: missing "messages"'),
                           (no_role, "no_role.jsonl:2: messages[0] must be an object")]:
        run = prepare(model_dir, data, out)
        assert run.returncode == 1 and expected in run.stderr, run.stderr
        assert not out.exists() and not pathlib.Path(str(out) + ".partial").exists()

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    run = prepare(empty_dir, write_chats(tmp_path / "chats.jsonl", CHATS), out)
    assert run.returncode == 1 and "no tokenizer could be loaded" in run.stderr, run.stderr
    run = prepare(make_model_dir(tmp_path / "plain", None), tmp_path / "chats.jsonl", out)
    assert run.returncode == 1 and "has no chat template" in run.stderr, run.stderr
    assert not out.exists()


def test_moefit_trains_and_evaluates_on_the_output(build_dir, tmp_path):
    model_dir = make_model_dir(tmp_path / "model", CHATML)
    out = tmp_path / "sft.jsonl"
    run = prepare(model_dir, write_chats(tmp_path / "chats.jsonl", CHATS * 8), out)
    assert run.returncode == 0, run.stderr
    vocab = len(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    common = ["--set", "data.format=jsonl", "--set", f"data.path={out}",
              "--set", f"model.vocab_size={vocab}", "--set", "model.num_hidden_layers=2",
              "--set", "train.seq_len=64", "--set", "train.micro_batch_size=2",
              "--set", "logging.metrics_file="]
    moefit = str((build_dir / "launch" / "moefit").resolve())
    env = dict(os.environ, MOEFIT_NUM_THREADS="1")
    train = subprocess.run([moefit, "train", "--set", "train.steps=3", *common], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300, env=env)
    assert train.returncode == 0, train.stdout + train.stderr
    assert "step 3/3" in train.stdout, train.stdout
    evaluate = subprocess.run([moefit, "eval", "--eval-sequences", "4", *common], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=env)
    assert evaluate.returncode == 0, evaluate.stdout + evaluate.stderr
    assert "eval: 4 sequences" in evaluate.stdout, evaluate.stdout
