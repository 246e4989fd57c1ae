"""Offline inference with the Python API.

    python examples/offline_inference.py [MODEL_DIR]

Without MODEL_DIR (and without DEEPINFER_HF_MODEL_DIR) it runs the embedded tiny model, whose random weights
produce meaningless text.
"""

import sys

from deepinfer import LLM, SamplingParams


def main() -> None:
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else None)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=48, seed=0)
    chats = [
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    ]
    for out in llm.chat(chats, params):
        print(f"--- reply {out.index} ({out.num_generated_tokens} tokens, {out.finish_reason})")
        print(out.text)
    raw = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_new_tokens=16))[0]
    print(f"--- raw completion: {raw.text!r}")

    # structured output: the reply is JSON under the schema, whatever the weights
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]},
                                               "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}},
              "required": ["city", "population_millions"], "additionalProperties": False}
    out = llm.chat([{"role": "user", "content": "Largest French city, as JSON."}], params,
                   so_args={"json_schema": schema})[0]
    print(f"--- constrained JSON: {out.text}")

    # a whole Chat Completions request with a tool; the answer is the API's response object
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}}, "required": ["city"]}}}
    response = llm.chat({"model": "deepinfer", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                         "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False,
                         "max_tokens": 200, "seed": 1})[0]
    print(f"--- tool call: {response.response['choices'][0]['message']['tool_calls']}")


if __name__ == "__main__":
    main()
