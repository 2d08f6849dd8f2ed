// The official openai npm client against a lumen gateway, for
// e2e/npm_test.go: it runs the calls a spec (a JSON file) lists and prints
// what the client returned as one JSON object; the Go test compares it with
// the engine's reference. Usage: node client.mjs spec.json
import { readFileSync } from 'node:fs';
import OpenAI from 'openai';

const spec = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const client = new OpenAI({ baseURL: spec.baseURL, apiKey: spec.apiKey, maxRetries: 0 });

// errorOf names the client's error class and what it read from the body.
function errorOf(err) {
  if (!(err instanceof OpenAI.APIError)) {
    return { class: err?.constructor?.name ?? typeof err, message: String(err) };
  }
  return {
    class: err.constructor.name,
    status: err.status ?? 0,
    message: err.error?.message ?? err.message,
    type: err.type ?? null,
    param: err.param ?? null,
    code: err.code ?? null,
  };
}

async function run(fn) {
  try {
    return { ok: await fn() };
  } catch (err) {
    return { error: errorOf(err) };
  }
}

const out = { completions: [], chat: {}, errors: {}, concurrent: [] };

for (const prompt of spec.prompts) {
  const params = { model: spec.model, prompt, max_tokens: spec.maxTokens, temperature: 0 };
  const plain = await run(async () => {
    const c = await client.completions.create({ ...params, logprobs: spec.topLogprobs });
    const ch = c.choices[0];
    return { text: ch.text, finish: ch.finish_reason, completion_tokens: c.usage.completion_tokens, logprobs: ch.logprobs };
  });
  const streamed = await run(async () => {
    const stream = await client.completions.create({ ...params, stream: true, logprobs: spec.topLogprobs });
    let text = '';
    let finish = null;
    const lp = { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
    for await (const chunk of stream) {
      for (const ch of chunk.choices) {
        text += ch.text;
        if (ch.finish_reason) finish = ch.finish_reason;
        if (ch.logprobs) for (const k of Object.keys(lp)) lp[k].push(...ch.logprobs[k]);
      }
    }
    return { text, finish, logprobs: lp };
  });
  out.completions.push({ plain, streamed });
}

const chatParams = {
  model: spec.model, messages: spec.messages, max_tokens: spec.chatMaxTokens, temperature: 0,
  logprobs: true, top_logprobs: spec.topLogprobs,
};
out.chat.plain = await run(async () => {
  const c = await client.chat.completions.create(chatParams);
  const ch = c.choices[0];
  return { content: ch.message.content, finish: ch.finish_reason, completion_tokens: c.usage.completion_tokens, logprobs: ch.logprobs.content };
});
out.chat.streamed = await run(async () => {
  const stream = await client.chat.completions.create({ ...chatParams, stream: true, stream_options: { include_usage: true } });
  let content = '';
  let finish = null;
  let usage = null;
  const lp = [];
  for await (const chunk of stream) {
    for (const ch of chunk.choices) {
      content += ch.delta?.content ?? '';
      if (ch.finish_reason) finish = ch.finish_reason;
      if (ch.logprobs?.content) lp.push(...ch.logprobs.content);
    }
    if (chunk.usage) usage = chunk.usage.completion_tokens;
  }
  return { content, finish, completion_tokens: usage, logprobs: lp };
});

// Two greedy samples, streamed: their chunks interleave, each with its
// index; both are the reference.
out.samples = await run(async () => {
  const stream = await client.completions.create({ ...params0(), max_tokens: spec.maxTokens, n: 2, stream: true });
  const texts = ['', ''];
  const finish = [null, null];
  for await (const chunk of stream) {
    for (const ch of chunk.choices) {
      texts[ch.index] += ch.text;
      if (ch.finish_reason) finish[ch.index] = ch.finish_reason;
    }
  }
  return { texts, finish };
});

// best_of 3 of greedy samples: one choice, the reference; the usage counts
// all three drawn.
out.bestOf = await run(async () => {
  const c = await client.completions.create({ ...params0(), max_tokens: spec.maxTokens, best_of: 3 });
  return { texts: c.choices.map((ch) => ch.text), completion_tokens: c.usage.completion_tokens };
});

// echo with logprobs and max_tokens 0 (lm-evaluation-harness's
// loglikelihood): the prompt and each of its tokens' logprobs, the first
// null.
out.echo = await run(async () => {
  const c = await client.completions.create({ ...params0(), max_tokens: 0, echo: true, logprobs: 1 });
  const ch = c.choices[0];
  return { text: ch.text, token_logprobs: ch.logprobs.token_logprobs, completion_tokens: c.usage.completion_tokens };
});

// Errors, each as the client's class.
const one = { model: spec.model, prompt: 'x', max_tokens: 1 };
out.errors.suffix = await run(() => client.completions.create({ ...one, suffix: 'end' }));
out.errors.unknownModel = await run(() => client.completions.create({ ...one, model: 'gpt-4' }));
out.errors.badTemperature = await run(() => client.completions.create({ ...one, temperature: 3 }));
out.errors.tooManyLogprobs = await run(() => client.completions.create({ ...one, logprobs: 21 }));
out.errors.chatTopLogprobs = await run(() => client.chat.completions.create({ ...chatParams, top_logprobs: 30 }));
out.errors.unknownPath = await run(() => client.embeddings.create({ model: spec.model, input: 'x' }));
out.errors.wrongKey = await run(() =>
  new OpenAI({ baseURL: spec.baseURL, apiKey: 'sk-wrong', maxRetries: 0 }).models.list());
out.models = await run(async () => (await client.models.list()).data.map((m) => m.id));

// A gateway that admits one request at a time, its slot held by a stream
// that has sent its first token: every request sent meanwhile is turned
// away with a RateLimitError. The held stream is then read to its end.
if (spec.limitedURL) {
  const limited = new OpenAI({ baseURL: spec.limitedURL, apiKey: spec.apiKey, maxRetries: 0 });
  const held = await limited.completions.create({ ...params0(), max_tokens: 64, stream: true });
  const it = held[Symbol.asyncIterator]();
  let text = (await it.next()).value.choices[0].text;
  out.concurrent = await Promise.all(
    Array.from({ length: 5 }, () => run(async () => (await limited.completions.create({ ...params0(), max_tokens: 64 })).choices[0].text)),
  );
  for (let r = await it.next(); !r.done; r = await it.next()) {
    text += r.value.choices[0]?.text ?? '';
  }
  out.held = text;
}
function params0() {
  return { model: spec.model, prompt: spec.prompts[0], temperature: 0 };
}

process.stdout.write(JSON.stringify(out));
