// Drives a Tandem engine with the official `openai` npm client and prints what it got back as
// JSON on stdout, for engine_server_test to check. Usage:
//   node openai_client_check.js BASE_URL MODEL PROMPT PROMPT_IDS_JSON
'use strict';
const OpenAI = require('openai');

// A streamed completion of `count` choices read to its end: each choice's text and finish
// reason, how many ids its chunks carried, and the usage chunk's usage.
async function readChoices(stream, count) {
  const texts = Array(count).fill(''), finishes = Array(count).fill(null), ids = new Set();
  let usage = null;
  for await (const chunk of stream) {
    ids.add(chunk.id);
    if (chunk.usage) usage = chunk.usage;
    for (const ch of chunk.choices) {
      texts[ch.index] += ch.text;
      if (ch.finish_reason) finishes[ch.index] = ch.finish_reason;
    }
  }
  return { texts, finishes, ids: ids.size, usage };
}

async function main() {
  const [baseURL, model, prompt, idsJson] = process.argv.slice(2);
  const ids = JSON.parse(idsJson);
  const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 120000 });
  const out = {};

  out.models = (await client.models.list()).data.map((m) => m.id);

  const greedy = { model, temperature: 0, max_tokens: 12, ignore_eos: true };
  const c = await client.completions.create({ ...greedy, prompt });
  out.completion = { text: c.choices[0].text, finish: c.choices[0].finish_reason, usage: c.usage,
                     object: c.object };

  const s = await client.completions.create({ ...greedy, prompt, stream: true,
                                              stream_options: { include_usage: true } });
  let text = '', finish = null, usage = null, chunks = 0;
  for await (const chunk of s) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    for (const ch of chunk.choices) {
      text += ch.text;
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  out.completion_stream = { text, finish, usage, chunks };

  const t = await client.completions.create({ ...greedy, prompt: ids });
  out.completion_ids = { text: t.choices[0].text };

  const messages = [{ role: 'user', content: prompt }];
  const chat = await client.chat.completions.create({ model, messages, temperature: 0, max_tokens: 10,
                                                     ignore_eos: true, logprobs: true, top_logprobs: 2 });
  out.chat = { content: chat.choices[0].message.content, role: chat.choices[0].message.role,
               finish: chat.choices[0].finish_reason, usage: chat.usage,
               logprobs: chat.choices[0].logprobs.content.length,
               top: chat.choices[0].logprobs.content[0].top_logprobs.length };
  const cs = await client.chat.completions.create({ model, messages, temperature: 0, max_tokens: 10,
                                                   ignore_eos: true, stream: true });
  let content = '', role = null, cfinish = null;
  for await (const chunk of cs) {
    for (const ch of chunk.choices) {
      if (ch.delta.role) role = ch.delta.role;
      if (ch.delta.content) content += ch.delta.content;
      if (ch.finish_reason) cfinish = ch.finish_reason;
    }
  }
  out.chat_stream = { content, role, finish: cfinish };

  // Several choices: n, and a list of prompts, whole and streamed. A prefill-decode gateway
  // makes each choice a request of its own; the client must not be able to tell.
  const several = {};
  const nw = await client.completions.create({ ...greedy, prompt, max_tokens: 6, n: 3 });
  several.n = { texts: nw.choices.map((x) => x.text), indexes: nw.choices.map((x) => x.index),
                usage: nw.usage };
  const prompts = [prompt, 'Hello world'];
  const lw = await client.completions.create({ ...greedy, prompt: prompts, max_tokens: 6 });
  several.list = { texts: lw.choices.map((x) => x.text), indexes: lw.choices.map((x) => x.index),
                   usage: lw.usage };
  const ls = await client.completions.create({ ...greedy, prompt: prompts, max_tokens: 6, stream: true,
                                               stream_options: { include_usage: true } });
  const lsRead = await readChoices(ls, 2);
  several.list_stream = { texts: lsRead.texts, ids: lsRead.ids, usage: lsRead.usage };
  const cn = await client.chat.completions.create({ model, messages, temperature: 0, max_tokens: 10,
                                                   ignore_eos: true, n: 2, stream: true });
  const contents = ['', ''];
  for await (const chunk of cn) {
    for (const ch of chunk.choices) if (ch.delta.content) contents[ch.index] += ch.delta.content;
  }
  several.chat_stream = { contents };
  // n choices of each prompt of a list: prompt-major (index = prompt * n + j), echoed whole.
  const nl = await client.completions.create({ ...greedy, prompt: prompts, max_tokens: 6, n: 2,
                                               echo: true });
  several.n_list = { texts: nl.choices.map((x) => x.text), indexes: nl.choices.map((x) => x.index),
                     usage: nl.usage };
  const nls = await client.completions.create({ ...greedy, prompt: prompts, max_tokens: 6, n: 2,
                                                stream: true, stream_options: { include_usage: true } });
  const nlsRead = await readChoices(nls, 4);
  several.n_list_stream = { texts: nlsRead.texts, ids: nlsRead.ids, usage: nlsRead.usage };
  out.several = several;

  // echo with max_tokens 0: the prompts alone, ended by "length", nothing generated.
  const eo = await client.completions.create({ model, prompt: prompts, echo: true, max_tokens: 0 });
  out.echo_only = { texts: eo.choices.map((x) => x.text), finishes: eo.choices.map((x) => x.finish_reason),
                    usage: eo.usage };
  const eos = await client.completions.create({ model, prompt: prompts, echo: true, max_tokens: 0,
                                                stream: true, stream_options: { include_usage: true } });
  const eosRead = await readChoices(eos, 2);
  out.echo_only_stream = { texts: eosRead.texts, finishes: eosRead.finishes, usage: eosRead.usage };
  // echo with logprobs (lm-evaluation-harness's loglikelihood): the prompt's tokens with their
  // logprobs first, the first without; whole and streamed alike. And vLLM's prompt_logprobs.
  const echoed = { ...greedy, prompt, echo: true, logprobs: 1, max_tokens: 2 };
  const el = (await client.completions.create(echoed)).choices[0].logprobs;
  out.echo_logprobs = { tokens: el.tokens, token_logprobs: el.token_logprobs,
                        first_top: el.top_logprobs[0], second_top: el.top_logprobs[1] };
  const els = await client.completions.create({ ...echoed, stream: true });
  const streamedEcho = { tokens: [], token_logprobs: [] };
  for await (const chunk of els) {
    for (const ch of chunk.choices) {
      if (!ch.logprobs) continue;
      streamedEcho.tokens.push(...ch.logprobs.tokens);
      streamedEcho.token_logprobs.push(...ch.logprobs.token_logprobs);
    }
  }
  out.echo_logprobs_stream = streamedEcho;
  const pl = await client.completions.create({ ...greedy, prompt, max_tokens: 1, prompt_logprobs: 1 });
  out.prompt_logprobs = pl.choices[0].prompt_logprobs;

  // Stop string: cut the greedy completion at a piece of its own text.
  const full = out.completion.text;
  const stop = full.length >= 4 ? full.slice(Math.floor(full.length / 2), Math.floor(full.length / 2) + 2) : null;
  if (stop) {
    const st = await client.completions.create({ ...greedy, prompt, stop: [stop] });
    out.stop = { stop, text: st.choices[0].text, finish: st.choices[0].finish_reason };
  }

  // Logprobs of tokens whose text is held back: a stop string that the whole answer so far
  // begins (and that never matches) holds every piece back until the answer ends, so the stream
  // has one chunk of text; it must still carry one logprob entry per token, as the whole answer.
  const six = { ...greedy, prompt, max_tokens: 6 };
  const sixText = (await client.completions.create(six)).choices[0].text;
  if (Buffer.byteLength(sixText) < 250) {
    const held = { ...six, logprobs: 1, stop: [sixText + '\u0007'] };
    const hw = await client.completions.create(held);
    const hs = await client.completions.create({ ...held, stream: true,
                                                 stream_options: { include_usage: true } });
    let htext = '', hentries = 0, husage = null;
    for await (const chunk of hs) {
      if (chunk.usage) husage = chunk.usage;
      for (const ch of chunk.choices) {
        htext += ch.text;
        if (ch.logprobs) hentries += ch.logprobs.tokens.length;
      }
    }
    out.held_logprobs = { whole_text: hw.choices[0].text, whole: hw.choices[0].logprobs.tokens.length,
                          whole_tokens: hw.usage.completion_tokens, text: htext, stream: hentries,
                          stream_tokens: husage.completion_tokens };
  }

  // logit_bias: +100 on one token makes every greedy token that one.
  const forced = ids[ids.length - 1];
  const lb = await client.completions.create({ ...greedy, prompt, max_tokens: 4,
                                               logit_bias: { [String(forced)]: 100 } });
  out.logit_bias = { token: forced, text: lb.choices[0].text };

  // Tools with tool_choice "auto": the answer is read for calls (a random model writes text).
  const weather = { type: 'function', function: { name: 'get_forecast', description: 'Forecast for a city',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } };
  const ta = await client.chat.completions.create({ model, messages, max_tokens: 4, temperature: 0,
                                                    tools: [weather] });
  out.tools_auto = { finish: ta.choices[0].finish_reason, content: ta.choices[0].message.content,
                     calls: (ta.choices[0].message.tool_calls || []).length };
  // Structured outputs: whatever the (random) model prefers, the answer follows the schema.
  const schema = { type: 'object', properties: {
    name: { type: 'string', maxLength: 10 }, n: { type: 'integer' },
    tags: { type: 'array', items: { enum: ['a', 'b'] }, maxItems: 2 } },
    required: ['name', 'n'], additionalProperties: false };
  const js = await client.chat.completions.create({ model, messages, max_tokens: 200, temperature: 0,
    response_format: { type: 'json_schema', json_schema: { name: 'person', schema, strict: true } } });
  out.json_schema = { schema, content: js.choices[0].message.content, finish: js.choices[0].finish_reason };
  const choice = await client.chat.completions.create({ model, messages, max_tokens: 20, temperature: 0,
                                                        guided_choice: ['sunny', 'rainy'] });
  out.guided_choice = { content: choice.choices[0].message.content };
  // A forced call, whole and streamed: parsed tool_calls whose arguments follow the parameters.
  const city = { type: 'function', function: { name: 'get_weather', description: 'Weather of a city',
    parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 12 } },
                  required: ['city'], additionalProperties: false } } };
  const named = await client.chat.completions.create({ model, messages, max_tokens: 200, temperature: 0,
    tools: [weather, city], tool_choice: { type: 'function', function: { name: 'get_weather' } } });
  const nm = named.choices[0].message;
  out.tool_named = { finish: named.choices[0].finish_reason, content: nm.content,
                     calls: (nm.tool_calls || []).map((c) => ({ id: c.id, type: c.type, name: c.function.name,
                                                                 arguments: JSON.parse(c.function.arguments) })) };
  const rs = await client.chat.completions.create({ model, messages, max_tokens: 300, temperature: 0,
    tools: [city], tool_choice: 'required', parallel_tool_calls: false, stream: true });
  const streamed = [];
  let rfinish = null;
  for await (const chunk of rs) {
    for (const ch of chunk.choices) {
      if (ch.finish_reason) rfinish = ch.finish_reason;
      for (const tc of (ch.delta.tool_calls || [])) {
        if (!streamed[tc.index]) streamed[tc.index] = { id: tc.id, name: '', arguments: '' };
        if (tc.function && tc.function.name) streamed[tc.index].name += tc.function.name;
        if (tc.function && tc.function.arguments) streamed[tc.index].arguments += tc.function.arguments;
      }
    }
  }
  out.tool_required_stream = { finish: rfinish, calls: streamed.map((c) => ({ id: c.id, name: c.name,
                                                                              arguments: JSON.parse(c.arguments) })) };

  // What the server cannot honour is a 400 naming the field, not free text.
  try {
    await client.chat.completions.create({ model, messages, max_tokens: 4, functions: [weather.function] });
    out.functions = { status: 200 };
  } catch (e) {
    out.functions = { status: e.status, param: e.error && e.error.param };
  }

  // Abort mid-stream: read two chunks, then cancel; the engine must free the request.
  const controller = new AbortController();
  const long = await client.completions.create(
      { model, prompt, max_tokens: 400, ignore_eos: true, stream: true },
      { signal: controller.signal });
  let got = 0, error = null;
  try {
    for await (const chunk of long) {
      if (++got === 2) controller.abort();
    }
  } catch (e) {
    error = e.constructor.name;  // some client versions end the loop quietly instead
  }
  out.abort = { chunks: got, error };

  try {
    await client.completions.create({ model, prompt, max_tokens: -1 });
    out.bad_request = { status: 0 };
  } catch (e) {
    out.bad_request = { status: e.status, type: e.error && e.error.type, message: e.error && e.error.message };
  }
  process.stdout.write(JSON.stringify(out) + '\n');
}

main().catch((e) => {
  process.stderr.write(`openai_client_check: ${e.stack || e}\n`);
  process.exit(1);
});
