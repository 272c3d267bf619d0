#!/usr/bin/env python3
"""Chat data to moefit's SFT JSONL, through a model directory's own tokenizer and chat template.

    prepare_sft.py MODEL_DIR data.jsonl out.jsonl

Input: one conversation per line, {"messages": [{"role": ..., "content": ...}, ...]}.
Output: one sample per line, {"input_ids": [...], "labels": [...]}, which `moefit train` reads
with data.format "jsonl" (and packs without letting samples see each other: framework/data.h).
The ids are exactly what the tokenizer's apply_chat_template gives for the conversation; labels
are -100 on everything but the assistant turns (their text and what the template closes them
with, such as an end-of-turn token), so only the answers are trained. Messages after the last
assistant turn train nothing and are left out; a conversation without an assistant turn is
skipped. When the rendered sample does not end with the tokenizer's EOS token, one is appended
(and trained), so that the model learns to stop.

Finding the assistant turns in the rendered text, in this order:
  1. A template with {% generation %} blocks marks them itself (transformers' assistant mask).
  2. Otherwise turn i spans from the end of the first i messages rendered with the generation
     prompt to the end of the first i + 1 messages rendered: exact for templates that render a
     conversation's beginning the same inside the whole.
  3. Templates that do not (Qwen3 drops earlier turns' reasoning) give one sample per assistant
     turn: the conversation up to it, only it trained, as the model sees it when answering.

Runs offline (local_files_only). Errors name the file and line; the exit status is non-zero (1
for bad data or model directory, 2 for bad arguments). The output appears complete or not at
all.
"""
import argparse
import json
import os
import re
import sys

IGNORE = -100
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Error(Exception):
    """A problem with the data or the model directory, reported as one line."""


def load_tokenizer(model_dir):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer  # slow import: after the arguments are checked

    if not os.path.isdir(model_dir):
        raise Error(f"{model_dir}: not a directory")
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a bad dir
        raise Error(f"{model_dir}: no tokenizer could be loaded "
                    f"({type(e).__name__}: {e})") from None
    if not getattr(tok, "chat_template", None):
        raise Error(f"{model_dir}: the tokenizer has no chat template "
                    "(chat_template.jinja, or chat_template in tokenizer_config.json)")
    if not tok.is_fast:
        raise Error(f"{model_dir}: needs a fast tokenizer (tokenizer.json) for token offsets")
    if tok.eos_token_id is None:
        raise Error(f"{model_dir}: the tokenizer defines no eos_token")
    return tok


def parse_messages(line, where):
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise Error(f"{where}: not valid JSON ({e})") from None
    if not isinstance(row, dict):
        raise Error(f"{where}: not a JSON object")
    if "messages" not in row:
        raise Error(f'{where}: missing "messages"')
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise Error(f'{where}: "messages" must be a non-empty array')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Error(f'{where}: messages[{i}] must be an object with a string "role"')
        if "content" not in m and "tool_calls" not in m:
            raise Error(f'{where}: messages[{i}] has no "content"')
    return messages


class Renderer:
    def __init__(self, tok, where):
        self.tok, self.where = tok, where

    def text(self, messages, generation_prompt=False):
        try:
            return self.tok.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception as e:  # the template's own checks (raise_exception), jinja errors
            raise Error(f"{self.where}: the chat template fails on this conversation "
                        f"({type(e).__name__}: {e})") from None

    def sample(self, text, spans):
        """Token ids of `text` and labels: a token is trained when it overlaps a span of trained
        characters (transformers' rule for assistant masks)."""
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        labels = []
        for token, (begin, end) in zip(ids, enc["offset_mapping"]):
            trained = any(end > s and begin < e for s, e in spans)
            labels.append(token if trained else IGNORE)
        return ids, labels


def assistant_turns(messages, where):
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if turns and turns[0] == 0:
        raise Error(f"{where}: the first message is the assistant's: there is no prompt before it")
    return turns


def samples_of(tok, messages, where, use_generation_blocks):
    """(ids, labels) of the samples one conversation gives (none without an assistant turn)."""
    turns = assistant_turns(messages, where)
    if not turns:
        return []
    messages = messages[:turns[-1] + 1]
    r = Renderer(tok, where)
    if use_generation_blocks:
        try:
            enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        except Exception as e:
            raise Error(f"{where}: the chat template fails on this conversation "
                        f"({type(e).__name__}: {e})") from None
        ids = list(enc["input_ids"])
        return [(ids, [t if m else IGNORE for t, m in zip(ids, enc["assistant_masks"])])]

    whole = r.text(messages)
    spans = []
    for i in turns:
        prompt, through = r.text(messages[:i], generation_prompt=True), r.text(messages[:i + 1])
        if not (whole.startswith(prompt) and whole.startswith(through) and
                len(prompt) < len(through)):
            spans = None
            break
        spans.append((len(prompt), len(through)))
    if spans is not None:
        return [r.sample(whole, spans)]
    # The template renders turns differently inside the whole: one sample per assistant turn.
    out = []
    for i in turns:
        prompt, text = r.text(messages[:i], generation_prompt=True), r.text(messages[:i + 1])
        if not text.startswith(prompt) or len(prompt) == len(text):
            raise Error(f"{where}: the chat template's generation prompt for message {i} is "
                        "not the beginning of the conversation rendered through it: cannot tell "
                        "the assistant's tokens apart")
        out.append(r.sample(text, [(len(prompt), len(text))]))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Tokenize chat data with a model's chat template into moefit's SFT JSONL "
                    "(only assistant turns trained).")
    p.add_argument("model_dir", help="model directory holding the tokenizer and its chat template")
    p.add_argument("data", help='input JSONL: {"messages": [{"role": ..., "content": ...}, ...]}')
    p.add_argument("out", help='output JSONL: {"input_ids": [...], "labels": [...]}')
    args = p.parse_args(argv)
    partial = args.out + ".partial"
    try:
        tok = load_tokenizer(args.model_dir)
        use_generation_blocks = bool(GENERATION_BLOCK.search(tok.chat_template))
        eos = tok.eos_token_id
        stats = dict(conversations=0, skipped=0, samples=0, tokens=0, trained=0, max_id=0)
        try:
            src = open(args.data, encoding="utf-8")
        except OSError as e:
            raise Error(f"{args.data}: cannot open ({e.strerror})") from None
        with src, open(partial, "w", encoding="utf-8") as dst:
            for line_no, line in enumerate(src, 1):
                if not line.strip():
                    continue
                where = f"{args.data}:{line_no}"
                messages = parse_messages(line, where)
                stats["conversations"] += 1
                samples = samples_of(tok, messages, where, use_generation_blocks)
                if not samples:
                    stats["skipped"] += 1
                for ids, labels in samples:
                    if not ids or ids[-1] != eos:
                        ids, labels = ids + [eos], labels + [eos]
                    dst.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
                    stats["samples"] += 1
                    stats["tokens"] += len(ids)
                    stats["trained"] += sum(1 for t in labels if t != IGNORE)
                    stats["max_id"] = max(stats["max_id"], max(ids))
        if stats["samples"] == 0:
            raise Error(f"{args.data}: no conversation with an assistant turn")
        os.replace(partial, args.out)
    except Error as e:
        if os.path.exists(partial):
            os.remove(partial)
        print(f"prepare_sft: {e}", file=sys.stderr)
        return 1
    print(f"prepare_sft: {stats['conversations']} conversations ({stats['skipped']} without an "
          f"assistant turn, skipped) -> {stats['samples']} samples, {stats['tokens']} tokens, "
          f"{stats['trained']} trained; largest id {stats['max_id']} (model.vocab_size must exceed "
          f"it); written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
