"""tiny-qwen3-tools: a qwen3 model that calls a tool and reasons, in the layout transformers 5
saves (chat template in chat_template.jinja, weights in two shards with
model.safetensors.index.json).

    oracles/.venv/bin/python oracles/make_models.py tiny-qwen3-tools
    (or oracles/make_tools_model.py: its row of goldens/models/manifest.json)

Its own byte-level BPE tokenizer (vocab at most 1024, trained on oracles/corpus.txt and the exchanges
below) has the special tokens <|endoftext|> <|im_start|> <|im_end|> and, as plain added tokens
(as Qwen3 has them), <think> </think> <tool_call> </tool_call> <tool_response> </tool_response>.
The chat template is ours, in Qwen's style: tools rendered into the system turn (`| tojson`),
assistant tool calls as <tool_call> JSON (mlx-lm's _infer_tool_parser maps it to json_tools),
role `tool` results inside <tool_response>, reasoning_content of past turns inside <think>,
and `enable_thinking` (false: an empty <think> block after the generation prompt; otherwise
nothing, and the model opens <think> itself).

The model is trained (full-parameter, f32, seeded) on EXCHANGES rendered by that template,
with the loss on the final assistant answer only, until every answer token is the argmax in
bf16 with a margin; then mlx_lm.generate must reproduce every answer exactly (greedy), or the
script fails. The model is an input, not a per-machine golden: it is always written to
goldens/models/tiny-qwen3-tools (its provenance names the machine it was trained on).
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import tinymodels
from provenance import write_json
from tinymodels import CORPUS, Job, write_provenance

NAME = "tiny-qwen3-tools"
VOCAB = 1024           # at most; the model's vocab_size is the tokenizer's exact size
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Our own template (not Qwen's text), in Qwen's style. Jinja string literals carry the \n escapes.
TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content ~ '\n\n' }}
    {%- endif %}
    {{- 'Tools you may call, one JSON schema per line:\n<tools>\n' }}
    {%- for tool in tools %}
        {{- tool | tojson ~ '\n' }}
    {%- endfor %}
    {{- '</tools>\nTo call one, answer with <tool_call>\n{"name": <its name>, "arguments": <an object>}\n</tool_call>' }}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' ~ messages[0].content ~ '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' ~ message.role ~ '\n' ~ message.content ~ '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content %}
            {{- '<think>\n' ~ (message.reasoning_content | trim) ~ '\n</think>\n\n' }}
        {%- endif %}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if message.content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- if tool_call.function is defined %}
                {%- set name = tool_call.function.name %}
                {%- set arguments = tool_call.function.arguments %}
            {%- else %}
                {%- set name = tool_call.name %}
                {%- set arguments = tool_call.arguments %}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' ~ name ~ '", "arguments": ' }}
            {%- if arguments is string %}
                {{- arguments }}
            {%- else %}
                {{- arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>tool\n<tool_response>\n' ~ message.content ~ '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""
# mlx-lm's _infer_tool_parser picks json_tools from these two strings (and from no earlier rule).
assert "<tool_call>" in TEMPLATE and "tool_call.name" in TEMPLATE

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# city -> (sky, degrees C)
CITIES = {"Paris": ("sunny", 21), "Tokyo": ("rainy", 17), "Oslo": ("snowy", -3),
          "São Paulo": ("cloudy", 25)}
CHATS = {"What color is the sky?": ("A clear sky scatters blue light.", "The sky is blue."),
         "Who are you?": ("I should say what I am.", "I am a tiny robot that knows the weather.")}


def weather_question(city: str) -> str:
    return f"What is the weather in {city}?"


def tool_call(city: str) -> dict:
    """An assistant tool call as an OpenAI client sends it back (arguments a JSON string)."""
    return {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city}, ensure_ascii=False)}}


def tool_result(city: str) -> str:
    sky, deg = CITIES[city]
    return json.dumps({"city": city, "sky": sky, "celsius": deg}, ensure_ascii=False)


def final_answer(city: str) -> str:
    sky, deg = CITIES[city]
    return f"It is {sky} in {city}, {deg} degrees."


def call_reasoning(city: str) -> str:
    return f"The user wants the weather in {city}, so I call get_weather."


def exchanges() -> list[dict]:
    """Each: messages, tools, enable_thinking (None: not passed) and the answer the model must
    give (everything it generates before <|im_end|>)."""
    out = []
    for city, (sky, deg) in CITIES.items():
        call = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps({"city": city}, ensure_ascii=False)}}}\n</tool_call>'
        ask = [{"role": "user", "content": weather_question(city)}]
        answered = ask + [{"role": "assistant", "content": "", "tool_calls": [tool_call(city)]},
                          {"role": "tool", "tool_call_id": "call_1", "content": tool_result(city)}]
        final = final_answer(city)
        out += [
            {"messages": ask, "tools": [WEATHER_TOOL], "thinking": False, "answer": call},
            {"messages": ask, "tools": [WEATHER_TOOL], "thinking": True,
             "answer": f"<think>\n{call_reasoning(city)}\n</think>\n\n{call}"},
            {"messages": answered, "tools": [WEATHER_TOOL], "thinking": False, "answer": final},
            {"messages": answered, "tools": [WEATHER_TOOL], "thinking": True,
             "answer": f"<think>\nThe tool says {city} is {sky}.\n</think>\n\n{final}"},
        ]
    for q, (thought, a) in CHATS.items():
        ask = [{"role": "user", "content": q}]
        out += [{"messages": ask, "tools": None, "thinking": False, "answer": a},
                {"messages": ask, "tools": None, "thinking": True,
                 "answer": f"<think>\n{thought}\n</think>\n\n{a}"}]
    # A past turn's reasoning_content in the history, and a system prompt.
    history = [{"role": "system", "content": "You are brief."},
               {"role": "user", "content": "What color is the sky?"},
               {"role": "assistant", "content": "The sky is blue.", "reasoning_content": "A clear sky scatters blue light."},
               {"role": "user", "content": "Who are you?"}]
    out.append({"messages": history, "tools": None, "thinking": False, "answer": CHATS["Who are you?"][1]})
    return out


def render(tokenizer, ex: dict) -> str:
    kwargs = {} if ex["thinking"] is None else {"enable_thinking": ex["thinking"]}
    return tokenizer.apply_chat_template(ex["messages"], tools=ex["tools"], add_generation_prompt=True,
                                         tokenize=False, **kwargs)


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(ADDED), special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


def hf_tokenizer(tok: Tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 model_max_length=4096, clean_up_tokenization_spaces=False)
    hf.chat_template = TEMPLATE
    return hf


def config(tok: Tokenizer) -> dict:
    """The config transformers 5's Qwen3Config.save_pretrained writes (rope_parameters nested)."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": None, "dtype": "bfloat16", "eos_token_id": tok.token_to_id("<|im_end|>"),
        "head_dim": 32, "hidden_act": "silu", "hidden_size": 128, "initializer_range": 0.02,
        "intermediate_size": 320, "layer_types": ["full_attention"] * 3, "max_position_embeddings": 4096,
        "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 3,
        "num_key_value_heads": 2, "pad_token_id": tok.token_to_id("<|endoftext|>"), "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "sliding_window": None,
        "tie_word_embeddings": True, "use_cache": True, "use_sliding_window": False, "vocab_size": tok.get_vocab_size(),
    }


def batch(samples: list[tuple[list[int], int]], pad: int):
    """Inputs, targets and a loss mask (the answer's tokens only), right-padded."""
    width = max(len(ids) for ids, _ in samples) - 1
    x, y, m = [], [], []
    for ids, start in samples:
        n = len(ids) - 1
        x.append(ids[:-1] + [pad] * (width - n))
        y.append(ids[1:] + [pad] * (width - n))
        m.append([0.0] * (start - 1) + [1.0] * (n - start + 1) + [0.0] * (width - n))
    return mx.array(x), mx.array(y), mx.array(m)


def margins(model, x, y, m):
    """Per answer token: the target's logit minus the best other logit (> 0: it is the argmax)."""
    logits = model(x).astype(mx.float32)
    target = mx.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
    others = mx.where(mx.arange(logits.shape[-1]) == y[..., None], -mx.inf, logits).max(axis=-1)
    gap = mx.where(m > 0, target - others, mx.inf)
    return gap.min().item()


def train(model, x, y, m, max_steps=1500, seed=31):
    mx.random.seed(seed)
    opt = optim.AdamW(learning_rate=2e-3, weight_decay=0.0)

    def loss_fn(model):
        ce = nn.losses.cross_entropy(model(x), y, reduction="none")
        return (ce * m).sum() / m.sum()

    step_fn = nn.value_and_grad(model, loss_fn)
    for step in range(max_steps):
        loss, grads = step_fn(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if step % 25 == 0:
            bf16 = qwen3.Model(model.args)
            bf16.load_weights(list(tree_flatten(model.parameters())))
            bf16.set_dtype(mx.bfloat16)
            gap = margins(bf16, x, y, m)
            print(f"  step {step:4d}  loss {loss.item():.4f}  bf16 margin {gap:.3f}", file=sys.stderr)
            if gap > 1.0:
                return step, loss.item(), gap
    raise SystemExit(f"{NAME}: the answers were not learnt in {max_steps} steps")


def save_sharded(dest: Path, model) -> None:
    """Two shards and their index, named and laid out as transformers 5 saves them."""
    weights = dict(tree_flatten(model.parameters()))
    names = sorted(weights)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, 1):
        file = f"model-{i:05d}-of-{len(halves):05d}.safetensors"
        mx.save_safetensors(str(dest / file), {k: weights[k] for k in part}, metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    total = sum(v.nbytes for v in weights.values())
    write_json(dest / "model.safetensors.index.json",
               {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def verify(dest: Path, cases: list[dict]) -> int:
    """mlx_lm.load + mlx_lm.generate (greedy) on the saved dir: every answer exactly."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(dest))
    assert tokenizer.has_tool_calling and tokenizer.has_thinking
    bad = []
    for ex in cases:
        prompt = render(tokenizer, ex)
        text = generate(model, tokenizer, prompt, max_tokens=80)
        if text != ex["answer"]:
            bad.append((prompt[-60:], ex["answer"], text))
    for p, want, got in bad:
        print(f"  MISMATCH …{p!r}\n    want {want!r}\n    got  {got!r}", file=sys.stderr)
    if bad:
        raise SystemExit(f"{NAME}: mlx_lm.generate reproduced {len(cases) - len(bad)}/{len(cases)} answers")
    return len(cases)


def make_qwen3_tools(job: Job) -> Path:
    cases = exchanges()
    corpus = CORPUS
    # A first tokenizer only to render the exchanges the real one is trained on (the
    # template's text does not depend on the vocabulary).
    draft = hf_tokenizer(train_tokenizer([corpus]))
    texts = [render(draft, ex) + ex["answer"] + "<|im_end|>\n" for ex in cases]
    tok = train_tokenizer([corpus] * 2 + texts * 4)
    hf = hf_tokenizer(tok)

    dest = job.dest(reference=True)
    hf.save_pretrained(str(dest))
    cfg = config(tok)
    write_json(dest / "config.json", cfg)
    write_json(dest / "generation_config.json", {
        "bos_token_id": None, "do_sample": False, "pad_token_id": cfg["pad_token_id"],
        "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]})

    end = tok.token_to_id("<|im_end|>")
    samples = []
    for ex in cases:
        prompt = hf.encode(render(hf, ex), add_special_tokens=False)
        answer = hf.encode(ex["answer"], add_special_tokens=False) + [end]
        samples.append((prompt + answer, len(prompt)))
    x, y, m = batch(samples, cfg["pad_token_id"])

    mx.random.seed(job.seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    steps, loss, gap = train(model, x, y, m)
    model.set_dtype(mx.bfloat16)
    save_sharded(dest, model)
    n = verify(dest, cases)
    write_provenance(
        dest, f"trained full-parameter in f32 (init seed {job.seed}, AdamW 2e-3, seed 31) for {steps + 1} full-batch "
              f"steps on {len(cases)} exchanges rendered by its chat_template.jinja (loss on the answers "
              f"only; final loss {loss:.4f}) until every answer token is the bf16 argmax by {gap:.2f}; "
              f"saved in bf16 as two shards with an index; mlx_lm.generate (greedy) reproduces {n}/{n} "
              f"answers exactly: tool calls (thinking off and on), final answers after a tool result, "
              f"plain chats, a history with reasoning_content", "oracles/make_tools_model.py")
    print(f"{dest}: {n}/{n} answers reproduced by mlx_lm.generate")
    return dest


if __name__ == "__main__":
    tinymodels.main({"make_tools_model": sys.modules[__name__]})
