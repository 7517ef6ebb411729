// LangChain JS (`@langchain/openai` ChatOpenAI, pinned by package-lock.json, installed by
// scripts/install-deps.sh with `npm ci`) against the real fwserve, on chat completions
// and with `useResponsesApi`: multi-turn by history replay with the reply pushed back,
// usage arithmetic, streaming, abort.
//
// Usage: node langchain_test.mjs FWSERVE_BINARY MODEL_DIR
import assert from "node:assert/strict";
import { ChatOpenAI } from "@langchain/openai";
import { HumanMessage } from "@langchain/core/messages";
import { withServer, rawChatText } from "./fwserve_process.mjs";

const [fwserve, modelDir] = process.argv.slice(2);
const TURNS = ["Good morrow", "And then?", "Speak on"];

function checkUsage(usage, label) {
  assert.ok(usage, `${label}: no usage_metadata`);
  assert.equal(usage.total_tokens, usage.input_tokens + usage.output_tokens, `${label}: total`);
  const cached = usage.input_token_details?.cache_read;
  if (cached !== undefined) assert.ok(cached <= usage.input_tokens, `${label}: cached within input`);
}

function textOf(message) {
  if (typeof message.content === "string") return message.content;
  return message.content.map((p) => p.text ?? "").join("");
}

await withServer(fwserve, modelDir, async (base) => {
  for (const useResponsesApi of [false, true]) {
    const label = useResponsesApi ? "responses" : "chat";
    const llm = new ChatOpenAI({ model: "aft-shakespeare", apiKey: "unused", temperature: 0,
                                 maxTokens: 8, maxRetries: 0, useResponsesApi,
                                 configuration: { baseURL: `${base}/v1` } });
    const history = [];
    const plain = [];
    for (const turn of TURNS) {
      history.push(new HumanMessage(turn));
      plain.push({ role: "user", content: turn });
      const reply = await llm.invoke(history);
      checkUsage(reply.usage_metadata, `${label} turn ${plain.length}`);
      const text = textOf(reply);
      assert.equal(text, await rawChatText(base, plain, 8), `${label}: turn text`);
      history.push(reply);  // the reply pushed back
      plain.push({ role: "assistant", content: text });
    }
    // Streaming gives the text invoke gives.
    let streamed = "";
    let usage = null;
    for await (const chunk of await llm.stream(history)) {
      streamed += textOf(chunk);
      if (chunk.usage_metadata) usage = chunk.usage_metadata;
    }
    assert.equal(streamed, textOf(await llm.invoke(history)), `${label}: streamed text`);
    checkUsage(usage, `${label} stream`);

    // Abort mid-stream.
    const controller = new AbortController();
    const long = new ChatOpenAI({ model: "aft-shakespeare", apiKey: "unused", maxTokens: 2000,
                                  maxRetries: 0, useResponsesApi,
                                  configuration: { baseURL: `${base}/v1` } });
    let got = 0;
    await assert.rejects(async () => {
      for await (const chunk of await long.stream("Once upon a time",
                                                  { signal: controller.signal })) {
        got += textOf(chunk).length;
        controller.abort();
      }
    });
    assert.ok(got < 2000, `${label}: ${got} bytes after abort`);
    assert.equal((await fetch(`${base}/health`)).status, 200);
  }
  console.log(`PASS: LangChain: chat and responses x ${TURNS.length} replayed turns, streams, aborts`);
});
