#!/usr/bin/python3
"""The prompt vLLM's chat endpoint renders for a request body, for the C++ API tests.

Run with Debian's interpreter (/usr/bin/python3), which has python3-jinja2. Reads a JSON file
(argv[1]):
  {"model": "deepseek_v3" | "qwen3", "body": {...the chat request...},
   "system_after_clients": "..."}   (optional: a system message inserted after the body's leading
                                      system messages, as Tandem describes tools to a template
                                      that does not show them)
and prints {"prompt": "..."} (or {"error": "..."}) as JSON.

What vLLM does, step by step:
  - tools: each validated by ChatCompletionToolsParam and passed as `tool.model_dump()`
    (vllm/entrypoints/openai/chat_completion/serving.py, render_chat_request). The models are
    ChatCompletionToolsParam(type: Literal["function"] = "function", function) and
    FunctionDefinition(name, description = None, parameters = None), both OpenAIBaseModel
    (extra="allow"): a dump lists the declared fields in declaration order, absent ones as None,
    then the extra fields in the order they were sent.
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
from render_chat_templates import load_config_template, make_environment  # noqa: E402


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
    source, special = load_config_template("tokenizer-" + spec["model"])
    body = spec["body"]
    messages = [vllm_message(m) for m in body["messages"]]
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
