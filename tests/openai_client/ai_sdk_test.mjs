// The Vercel AI SDK (`ai`, `@ai-sdk/openai`, `@ai-sdk/openai-compatible`, pinned by
// package-lock.json, installed by scripts/install-deps.sh with `npm ci`) against the
// real fwserve, as applications use it: multi-turn by history replay with the reply
// pushed back (`result.response.messages`) through the Responses API (the provider's
// default, with `store` on: item_reference; and off: messages with their ids), chat
// completions and the openai-compatible provider; usage arithmetic; streaming; abort.
//
// Usage: node ai_sdk_test.mjs FWSERVE_BINARY MODEL_DIR
import assert from "node:assert/strict";
import { generateText, streamText } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { withServer, rawChatText } from "./fwserve_process.mjs";

const [fwserve, modelDir] = process.argv.slice(2);
const MODEL = "aft-shakespeare";
const TURNS = ["Good morrow", "And then?", "Speak on"];

function checkUsage(usage, label) {
  assert.equal(usage.totalTokens, usage.inputTokens + usage.outputTokens, `${label}: total`);
  const details = usage.inputTokenDetails ?? {};
  if (details.cacheReadTokens !== undefined) {
    assert.ok(details.cacheReadTokens <= usage.inputTokens, `${label}: cached within input`);
  }
  if (details.noCacheTokens !== undefined) {
    assert.ok(details.noCacheTokens >= 0, `${label}: noCacheTokens ${details.noCacheTokens}`);
  }
}

await withServer(fwserve, modelDir, async (base) => {
  const openai = createOpenAI({ baseURL: `${base}/v1`, apiKey: "unused" });
  const compatible = createOpenAICompatible({ name: "fwserve", baseURL: `${base}/v1`,
                                              apiKey: "unused", includeUsage: true });
  const variants = [
    ["responses (store on: item_reference)", openai(MODEL), {}],
    ["responses (store off: message ids)", openai(MODEL), { openai: { store: false } }],
    ["chat", openai.chat(MODEL), {}],
    ["openai-compatible", compatible.chatModel(MODEL), {}],
  ];
  const texts = {};
  for (const [label, model, providerOptions] of variants) {
    // History replay: every turn sends the whole conversation, the replies pushed back.
    const messages = [];
    const plain = [];
    texts[label] = [];
    for (const turn of TURNS) {
      messages.push({ role: "user", content: turn });
      plain.push({ role: "user", content: turn });
      const result = await generateText({ model, messages, maxOutputTokens: 8, temperature: 0,
                                          providerOptions, maxRetries: 0 });
      checkUsage(result.usage, `${label} turn ${plain.length}`);
      assert.equal(result.text, await rawChatText(base, plain, 8), `${label}: turn text`);
      texts[label].push(result.text);
      messages.push(...result.response.messages);
      plain.push({ role: "assistant", content: result.text });
    }
    // Streaming gives the text generateText gives.
    let streamed = "";
    const stream = streamText({ model, messages, maxOutputTokens: 8, temperature: 0,
                                providerOptions, maxRetries: 0 });
    for await (const delta of stream.textStream) streamed += delta;
    checkUsage(await stream.usage, `${label} stream`);
    const unary = await generateText({ model, messages, maxOutputTokens: 8, temperature: 0,
                                       providerOptions, maxRetries: 0 });
    assert.equal(streamed, unary.text, `${label}: streamed text`);

    // Abort mid-stream: the stream ends with an abort, and the server serves on.
    const controller = new AbortController();
    const long = streamText({ model, prompt: "Once upon a time", maxOutputTokens: 2000,
                              providerOptions, abortSignal: controller.signal, maxRetries: 0 });
    let got = 0;
    let aborted = false;
    try {
      for await (const delta of long.textStream) {
        got += delta.length;
        if (got > 0) controller.abort();
      }
    } catch (e) {
      aborted = true;
    }
    assert.ok(aborted || controller.signal.aborted, `${label}: not aborted`);
    assert.ok(got < 2000, `${label}: ${got} bytes after abort`);
    assert.equal((await fetch(`${base}/health`)).status, 200);
  }
  // Every route renders the same history: the same greedy texts.
  const [first, ...rest] = Object.values(texts);
  for (const other of rest) assert.deepEqual(other, first);

  // An unknown model: the SDK's typed 404.
  await assert.rejects(generateText({ model: openai("nope"), prompt: "x", maxRetries: 0 }),
                       (e) => e.statusCode === 404 && /model_not_found/.test(e.responseBody));
  console.log(`PASS: AI SDK: ${variants.length} routes x ${TURNS.length} replayed turns, ` +
              `streams and aborts`);
});
