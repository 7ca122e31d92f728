// Drives a Tandem engine started with --reasoning-parser through the official `openai` npm client:
// one chat whole and streamed with thinking on, and once more with enable_thinking false, printing
// what the client read (message.reasoning_content / content, and the streamed deltas folded) as
// JSON for engine_server_test. Usage: node openai_reasoning_check.js BASE_URL MODEL PROMPT
'use strict';
const OpenAI = require('openai');

async function main() {
  const [baseURL, model, prompt] = process.argv.slice(2);
  const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 120000 });
  const out = {};
  for (const thinking of [true, false]) {
    const request = { model, messages: [{ role: 'user', content: prompt }], temperature: 0,
                      max_tokens: 12, ignore_eos: true,
                      chat_template_kwargs: { enable_thinking: thinking } };
    const whole = await client.chat.completions.create(request);
    const message = whole.choices[0].message;
    const stream = await client.chat.completions.create({ ...request, stream: true });
    let reasoning = null, content = null, reasoningAlias = null;
    for await (const chunk of stream) {
      for (const ch of chunk.choices) {
        if (typeof ch.delta.reasoning_content === 'string')
          reasoning = (reasoning ?? '') + ch.delta.reasoning_content;
        if (typeof ch.delta.reasoning === 'string')
          reasoningAlias = (reasoningAlias ?? '') + ch.delta.reasoning;
        if (ch.delta.content) content = (content ?? '') + ch.delta.content;
      }
    }
    out[thinking ? 'thinking' : 'not_thinking'] = {
      whole: { reasoning: message.reasoning_content ?? null, reasoning_alias: message.reasoning ?? null,
               content: message.content, finish: whole.choices[0].finish_reason },
      stream: { reasoning, reasoning_alias: reasoningAlias, content } };
  }
  process.stdout.write(JSON.stringify(out));
}

main().catch((e) => { console.error(e); process.exit(1); });
