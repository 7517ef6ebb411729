// Benchmark (not a test): a chat replayed in full each turn, as stateless clients send
// it, against fwserve with the kept conversations on (--prefix-reuse-entries 64) and off
// (0), and the same chat continued by previous_response_id (the stateful way) as the
// yardstick. Clients: raw HTTP chat completions (fetch, SSE) and the AI SDK
// (`streamText`, pinned by this folder's package-lock.json) on `openai.chat` and on its
// default, the Responses API with store on. Per turn: time to the
// first text and the server's CPU time for the request (the sum over its threads of
// /proc/PID/task/*/schedstat). Rounds alternate the arms (on, off, previous_response_id,
// then again), and the table gives each turn's median over the rounds.
//
// Usage: node replay_bench.mjs FWSERVE_BINARY MODEL_DIR TEXT_FILE [TURNS=10] [ROUNDS=3]
// Example (docs/benchmarks.md "Replayed histories"):
//   node tests/openai_client/replay_bench.mjs build/server/fwserve \
//     models/pretrained/aft-shakespeare models/data/tinyshakespeare.txt 10 3
import { spawn } from "node:child_process";
import fs from "node:fs";
import { streamText } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { freePort, waitHealthy } from "./fwserve_process.mjs";

const [fwserve, modelDir, textFile, turnsArg, roundsArg] = process.argv.slice(2);
if (!fwserve || !modelDir || !textFile) {
  console.error("usage: node replay_bench.mjs FWSERVE_BINARY MODEL_DIR TEXT_FILE [TURNS] [ROUNDS]");
  process.exit(2);
}
const TURNS = Number(turnsArg ?? 10);
const ROUNDS = Number(roundsArg ?? 3);
const USER_BYTES = 300;
const OUTPUT_TOKENS = 32;
const MODEL = modelDir.replace(/\/+$/, "").split("/").pop();
const corpus = fs.readFileSync(textFile, "latin1").replace(/[^\x20-\x7e\n]/g, "");
const userTurn = (i) => corpus.slice(1000 + i * USER_BYTES, 1000 + (i + 1) * USER_BYTES);

async function startServer(extra) {
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const child = spawn(fwserve, ["--listen", "127.0.0.1:0", "--metrics-listen", "", "--model",
                                modelDir, "--http-listen", `127.0.0.1:${port}`, "--threads", "1",
                                "--log-level", "warning", ...extra],
                      { stdio: ["ignore", "ignore", "inherit"] });
  await waitHealthy(base, child);
  return { base, child };
}

// Nanoseconds the process has run, over all its threads.
function cpuNs(pid) {
  let total = 0;
  for (const task of fs.readdirSync(`/proc/${pid}/task`)) {
    try {
      total += Number(fs.readFileSync(`/proc/${pid}/task/${task}/schedstat`, "utf8").split(" ")[0]);
    } catch {}
  }
  return total;
}

// Reads an SSE response until its end; returns ms to the first event `isText` accepts.
async function firstTextMs(response, start, isText) {
  let first = null;
  let buffer = "";
  const decoder = new TextDecoder();
  for await (const part of response.body) {
    buffer += decoder.decode(part, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").find((l) => l.startsWith("data: "));
      // Every event goes to `isText` (it collects the text), the first text is timed.
      if (data && data !== "data: [DONE]" && isText(JSON.parse(data.slice(6))) && first === null) {
        first = performance.now() - start;
      }
    }
  }
  return first;
}

async function rawChatTurn(base, messages) {
  const start = performance.now();
  const response = await fetch(`${base}/v1/chat/completions`, {
    method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: MODEL, messages, max_tokens: OUTPUT_TOKENS, temperature: 0,
                           stream: true, stream_options: { include_usage: true } }),
  });
  if (!response.ok) throw new Error(`chat: ${response.status} ${await response.text()}`);
  let text = "";
  const ttft = await firstTextMs(response, start, (e) => {
    const delta = e.choices?.[0]?.delta?.content;
    if (delta) text += delta;
    return Boolean(delta);
  });
  return { ttft, text };
}

async function aiSdkTurn(model, messages) {
  const start = performance.now();
  const result = streamText({ model, messages, maxOutputTokens: OUTPUT_TOKENS, temperature: 0,
                              maxRetries: 0 });
  let ttft = null;
  for await (const part of result.textStream) {
    if (ttft === null && part.length > 0) ttft = performance.now() - start;
  }
  return { ttft, responseMessages: (await result.response).messages };
}

async function previousResponseTurn(base, input, previous) {
  const start = performance.now();
  const response = await fetch(`${base}/v1/responses`, {
    method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: MODEL, input, max_output_tokens: OUTPUT_TOKENS, temperature: 0,
                           stream: true, ...(previous ? { previous_response_id: previous } : {}) }),
  });
  if (!response.ok) throw new Error(`responses: ${response.status} ${await response.text()}`);
  let id = null;
  const ttft = await firstTextMs(response, start, (e) => {
    if (e.type === "response.created") id = e.response.id;
    return e.type === "response.output_text.delta" && e.delta.length > 0;
  });
  return { ttft, id };
}

// One conversation of TURNS turns on `server` through `client`; per turn {ttft, cpu}.
async function conversation(server, client) {
  const rows = [];
  const messages = [];
  let previous = null;
  const provider = createOpenAI({ baseURL: `${server.base}/v1`, apiKey: "unused" });
  // The provider's default model is the Responses API (store on: the replies pushed back
  // as item references); .chat is chat completions.
  const model = client === "aisdk-responses" ? provider(MODEL) : provider.chat(MODEL);
  for (let turn = 0; turn < TURNS; turn++) {
    const user = userTurn(turn);
    const cpu0 = cpuNs(server.child.pid);
    let ttft;
    if (client === "raw") {
      messages.push({ role: "user", content: user });
      const r = await rawChatTurn(server.base, messages);
      messages.push({ role: "assistant", content: r.text });
      ttft = r.ttft;
    } else if (client === "aisdk" || client === "aisdk-responses") {
      messages.push({ role: "user", content: user });
      const r = await aiSdkTurn(model, messages);
      messages.push(...r.responseMessages);
      ttft = r.ttft;
    } else {
      const r = await previousResponseTurn(server.base, user, previous);
      previous = r.id;
      ttft = r.ttft;
    }
    rows.push({ ttft, cpu: (cpuNs(server.child.pid) - cpu0) / 1e6 });
  }
  return rows;
}

const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)];
};

const on = await startServer([]);
const off = await startServer(["--prefix-reuse-entries", "0"]);
const arms = [
  ["raw, reuse on", on, "raw"], ["raw, reuse off", off, "raw"],
  ["AI SDK, reuse on", on, "aisdk"], ["AI SDK, reuse off", off, "aisdk"],
  ["AI SDK responses, reuse on", on, "aisdk-responses"],
  ["AI SDK responses, reuse off", off, "aisdk-responses"],
  ["previous_response_id", on, "previous"],
];
const results = Object.fromEntries(arms.map(([label]) => [label, []]));
try {
  for (let round = 0; round < ROUNDS; round++) {
    for (const [label, server, client] of arms) results[label].push(await conversation(server, client));
  }
} finally {
  on.child.kill("SIGTERM");
  off.child.kill("SIGTERM");
}
const cell = (label, turn, key) => median(results[label].map((rows) => rows[turn][key]));
console.log(`fwserve ${MODEL}: ${TURNS} turns of ${USER_BYTES}-byte user messages, ` +
            `${OUTPUT_TOKENS} tokens a reply, ${ROUNDS} rounds, medians; ms`);
console.log(`| turn | ${arms.map(([l]) => `${l} TTFT | ${l} CPU`).join(" | ")} |`);
console.log(`|---|${arms.map(() => "---|---|").join("")}`);
for (let turn = 0; turn < TURNS; turn++) {
  console.log(`| ${turn + 1} | ${arms.map(([l]) => `${cell(l, turn, "ttft").toFixed(1)} | ${
    cell(l, turn, "cpu").toFixed(1)}`).join(" | ")} |`);
}
console.log(JSON.stringify(results));
