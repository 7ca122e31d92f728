#!/usr/bin/python3
"""The prompt vLLM's chat endpoint renders for a request body, for the C++ API tests.

Run with Debian's interpreter (/usr/bin/python3), which has python3-jinja2. Reads a JSON file
(argv[1]):
  {"model": "deepseek_v3" | "qwen3", "body": {...the chat request...},
   "system_after_clients": "...",   (optional: a system message inserted after the body's leading
                                      system messages, as Tandem describes tools to a template
                                      that does not show them)
   "template_file": "llama-3.1.jinja",  (optional: a template of tests/data/chat_templates with
                                         its tokenizer's special tokens, in place of the model's)
   "arguments_as_sent": true}        (optional: tool-call arguments reach the template as sent,
                                      Tandem's rule for a template that concatenates them, where
                                      vLLM's parsed arguments fail)
and prints {"prompt": "..."} (or {"error": "..."}) as JSON.

What vLLM does, step by step:
  - tools: each validated by ChatCompletionToolsParam and passed as `tool.model_dump()`
    (vllm/entrypoints/openai/chat_completion/serving.py, render_chat_request). The models are
    ChatCompletionToolsParam(type: Literal["function"] = "function", function) and
    FunctionDefinition(name, description = None, parameters = None), both OpenAIBaseModel
    (extra="allow"): a dump lists the declared fields in declaration order, absent ones as None,
    then the extra fields in the order they were sent.
  - an assistant turn's tool calls (chat_utils.py, _postprocess_messages, called by
    parse_chat_messages for every template): a null `tool_calls` is not passed
    (_parse_chat_message_content copies only a non-null one) and an empty list is dropped; each
    call's `function.arguments`, a JSON string in OpenAI's format, is given as the object it
    holds: "", null or absent as {}, an object sent as one kept, a string that is not JSON or
    holds no object as {} (as vLLM does since PR #48922, merged 2026-07-17; up to 0.25.1 a
    string that is not JSON was a 400 with json.loads' message, and a JSON scalar was passed on).
  - messages: an assistant turn's `reasoning` is given under both names, `reasoning` and
    `reasoning_content` (chat_utils.py, _parse_chat_message_content). vLLM builds each message
    anew from role, content, tool_calls, reasoning, tool_call_id and name; the others pass as
    sent here, as transformers passes them (and Tandem): tests send no others to compare.
  - the template is rendered in transformers' environment (render_chat_templates.py) with the
    keyword arguments apply_chat_template passes.
  - continue_final_message: transformers' cut (apply_chat_template): the rendering ends after the
    final message's content, found by its last occurrence.
Messages must have string contents (the format both templates read).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from render_chat_templates import (load_config_template, load_file_template,  # noqa: E402
                                   make_environment)


def dumped_tool(tool):
    """ChatCompletionToolsParam(**tool).model_dump()."""
    if tool.get("type", "function") != "function":
        raise ValueError("type must be 'function'")
    function = tool["function"]
    declared = {"name": function["name"], "description": function.get("description"),
                "parameters": function.get("parameters")}
    declared.update({k: v for k, v in function.items() if k not in declared})
    out = {"type": "function", "function": declared}
    out.update({k: v for k, v in tool.items() if k not in ("type", "function")})
    return out


def vllm_message(message):
    """An assistant's reasoning under both names, as vLLM gives it to the template."""
    out = dict(message)
    if message.get("role") == "assistant" and message.get("reasoning") is not None:
        out["reasoning"] = message["reasoning"]
        out["reasoning_content"] = message["reasoning"]
    return out


def vllm_tool_calls(message):
    """_postprocess_messages on one message (which it changes in place)."""
    if message.get("role") != "assistant" or "tool_calls" not in message:
        return
    if not message["tool_calls"]:
        del message["tool_calls"]
        return
    for call in message["tool_calls"]:
        function = call["function"]
        arguments = function.get("arguments")
        parsed = {}
        if isinstance(arguments, dict):
            parsed = arguments
        elif isinstance(arguments, str) and arguments:
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = {}
        function["arguments"] = parsed if isinstance(parsed, dict) else {}


def continued(rendered, final_message):
    """transformers' apply_chat_template with continue_final_message=True."""
    if final_message.strip() not in rendered:
        raise ValueError("the final message does not appear in the chat")
    at = rendered.rindex(final_message.strip())
    if rendered[at:at + len(final_message.lstrip())] == final_message:
        return rendered[:at + len(final_message.lstrip())]
    return rendered[:at + len(final_message.strip())]


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    if "template_file" in spec:
        source, special = load_file_template(spec["template_file"],
                                             {"bos_token": "<|begin_of_text|>",
                                              "eos_token": "<|eot_id|>"})
    else:
        source, special = load_config_template("tokenizer-" + spec["model"])
    body = spec["body"]
    messages = [vllm_message(m) for m in body["messages"]]
    if not spec.get("arguments_as_sent"):
        for m in messages:
            vllm_tool_calls(m)
    if "system_after_clients" in spec:
        at = 0
        while at < len(messages) and messages[at]["role"] == "system":
            at += 1
        messages.insert(at, {"role": "system", "content": spec["system_after_clients"]})
    tools = [dumped_tool(t) for t in body["tools"]] if body.get("tools") is not None else None
    add_generation_prompt = body.get("add_generation_prompt", True)
    context = {"messages": messages, "tools": tools, "documents": None,
               "add_generation_prompt": add_generation_prompt}
    context.update(special)
    context.update(body.get("chat_template_kwargs") or {})
    try:
        prompt = make_environment().from_string(source).render(**context)
        if body.get("continue_final_message"):
            prompt = continued(prompt, body["messages"][-1]["content"])
        out = {"prompt": prompt}
    except Exception as e:  # noqa: BLE001 - the C++ test reports it
        out = {"error": f"{type(e).__name__}: {e}"}
    json.dump(out, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
