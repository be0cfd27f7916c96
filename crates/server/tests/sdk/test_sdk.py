"""The official `openai` and `anthropic` Python SDKs against `redlite serve`.

The server runs the tiny fixture model with a replay file, so the model's turns (text and tool
calls) are known exactly. Usage: test_sdk.py BASE_URL API_KEY. The replay file given to the
server must be REPLIES below, in order: each request that reaches the model takes the next one.
Prints one line per check and closes with 'N passed, N failed'.
"""

import json
import sys

import anthropic
import openai

REPLIES = [
    # 1: openai chat, tool call (XML form)
    "Checking.\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n</function>\n</tool_call>",
    # 2: openai chat, final answer, streamed
    "The file has a main function.",
    # 3: openai chat, streamed tool call (JSON form)
    "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"Cargo.toml\"}}\n</tool_call>",
    # 4: anthropic, tool use
    "<tool_call>\n<function=read_file>\n<parameter=path>\nREADME.md\n</parameter>\n</function>\n</tool_call>",
    # 5: anthropic, final answer, streamed
    "It is a README.",
    # 6: anthropic, streamed tool use
    "Let me look.\n<tool_call>\n<function=read_file>\n<parameter=path>\nlib.rs\n</parameter>\n</function>\n</tool_call>",
]

TOOLS_OPENAI = [{
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}]
TOOLS_ANTHROPIC = [{
    "name": "read_file",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}]

passed = 0
failed = 0


def check(name, fn):
    global passed, failed
    try:
        fn()
        passed += 1
        print(f"ok   {name}")
    except Exception as e:  # noqa: BLE001 - report every failure and go on
        failed += 1
        print(f"FAIL {name}: {type(e).__name__}: {e}")


def main():
    base, key = sys.argv[1], sys.argv[2]
    oai = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    ant = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)
    state = {}

    def models():
        ms = oai.models.list()
        assert len(ms.data) == 1 and ms.data[0].id

    def chat_tool_call():
        msgs = [{"role": "user", "content": "What is in src/main.rs?"}]
        r = oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OPENAI, max_tokens=200,
                                        extra_body={"stream_options": None}, store=False,
                                        parallel_tool_calls=True)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.content == "Checking.\n", ch.message.content
        tc = ch.message.tool_calls[0]
        assert tc.function.name == "read_file"
        assert json.loads(tc.function.arguments) == {"path": "src/main.rs"}
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
        msgs.append(ch.message.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": tc.id, "content": "fn main() {}"})
        state["msgs"] = msgs

    def chat_stream_final():
        stream = oai.chat.completions.create(model="m", messages=state["msgs"], tools=TOOLS_OPENAI,
                                             max_tokens=200, stream=True,
                                             stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        assert text == REPLIES[1], text
        assert finish == "stop", finish
        assert usage and usage.completion_tokens > 0
        assert usage.prompt_tokens_details.cached_tokens >= 0

    def chat_stream_tool_call():
        stream = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Cargo?"}],
                                             tools=TOOLS_OPENAI, max_tokens=200, stream=True)
        calls, finish = {}, None
        for chunk in stream:
            for c in chunk.choices:
                for tc in c.delta.tool_calls or []:
                    d = calls.setdefault(tc.index, {"name": "", "args": ""})
                    d["name"] += tc.function.name or ""
                    d["args"] += tc.function.arguments or ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls", finish
        assert calls[0]["name"] == "read_file" and json.loads(calls[0]["args"]) == {"path": "Cargo.toml"}

    def anthropic_tool_use():
        msgs = [{"role": "user", "content": "Read the README"}]
        r = ant.messages.create(model="m", max_tokens=200, messages=msgs, tools=TOOLS_ANTHROPIC,
                                system="Be brief.")
        assert r.stop_reason == "tool_use", r
        tu = [b for b in r.content if b.type == "tool_use"][0]
        assert tu.name == "read_file" and tu.input == {"path": "README.md"}
        msgs.append({"role": "assistant", "content": [b.model_dump() for b in r.content]})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id,
                                                   "content": "# redlite"}]})
        state["amsgs"] = msgs

    def anthropic_stream_final():
        with ant.messages.stream(model="m", max_tokens=200, messages=state["amsgs"],
                                 tools=TOOLS_ANTHROPIC) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert text == REPLIES[4], text
        assert final.stop_reason == "end_turn"

    def anthropic_stream_tool_use():
        with ant.messages.stream(model="m", max_tokens=200, tools=TOOLS_ANTHROPIC,
                                 messages=[{"role": "user", "content": "lib?"}]) as s:
            final = s.get_final_message()
        assert final.stop_reason == "tool_use", final
        assert final.content[0].type == "text" and final.content[0].text == "Let me look.\n"
        assert final.content[1].type == "tool_use" and final.content[1].input == {"path": "lib.rs"}

    def errors():
        try:
            oai.chat.completions.create(model="m", messages=[], max_tokens=5)
            raise AssertionError("no error")
        except openai.BadRequestError as e:
            assert e.status_code == 400
        try:
            ant.messages.create(model="m", max_tokens=-1, messages=[{"role": "user", "content": "x"}])
            raise AssertionError("no error")
        except anthropic.BadRequestError as e:
            assert e.status_code == 400
        bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        try:
            bad.models.list()
            raise AssertionError("no error")
        except openai.AuthenticationError:
            pass

    check("openai models", models)
    check("openai chat tool call", chat_tool_call)
    check("openai chat stream after tool result", chat_stream_final)
    check("openai chat streamed tool call", chat_stream_tool_call)
    check("anthropic tool_use", anthropic_tool_use)
    check("anthropic stream after tool_result", anthropic_stream_final)
    check("anthropic streamed tool_use", anthropic_stream_tool_use)
    check("errors", errors)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--replies":
        print(json.dumps(REPLIES))
        sys.exit(0)
    sys.exit(main())
