// The official `openai` npm package (pinned by package-lock.json, installed by
// scripts/install-deps.sh with `npm ci`) against a real fwserve with --http-listen:
// streams a chat completion, asks for n choices, and continues a response by
// previous_response_id.
//
// Usage: node openai_client_test.mjs FWSERVE_BINARY MODEL_DIR
import assert from "node:assert/strict";
import OpenAI from "openai";
import { withServer } from "./fwserve_process.mjs";

const [fwserve, model] = process.argv.slice(2);

await withServer(fwserve, model, async (base) => {
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0 });

  const models = await client.models.list();
  assert.equal(models.data[0].id, "aft-shakespeare");

  // A streamed chat completion.
  const stream = await client.chat.completions.create({
    model: "aft-shakespeare",
    messages: [{ role: "user", content: "Good morrow" }],
    max_tokens: 24,
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = "";
  let deltas = 0;
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    const choice = chunk.choices[0];
    if (!choice) continue;
    if (choice.delta?.content) { text += choice.delta.content; deltas++; }
    if (choice.finish_reason) finish = choice.finish_reason;
  }
  assert.ok(deltas >= 1, "no content deltas");
  assert.equal(finish, "length");
  assert.equal(usage.completion_tokens, 24);
  const unary = await client.chat.completions.create({
    model: "aft-shakespeare",
    messages: [{ role: "user", content: "Good morrow" }],
    max_tokens: 24,
    temperature: 0,
  });
  assert.equal(unary.choices[0].message.content, text);
  // Usage by OpenAI's rule: total = prompt + completion.
  assert.equal(unary.usage.total_tokens, unary.usage.prompt_tokens + unary.usage.completion_tokens);

  // The documented multi-turn pattern: the reply pushed back as it came.
  const messages = [{ role: "user", content: "Good morrow" }];
  messages.push(unary.choices[0].message);
  messages.push({ role: "user", content: "And then?" });
  const pushed = await client.chat.completions.create({
    model: "aft-shakespeare", messages, max_completion_tokens: 8, temperature: 0,
  });
  const plain = await client.chat.completions.create({
    model: "aft-shakespeare", max_tokens: 8, temperature: 0,
    messages: [{ role: "user", content: "Good morrow" }, { role: "assistant", content: text },
               { role: "user", content: "And then?" }],
  });
  assert.equal(pushed.choices[0].message.content, plain.choices[0].message.content);

  // n choices (issue 51): the SDK's own types, whole and streamed; every index answered,
  // the prompt counted once, the streamed choices equal to the whole ones.
  const several = { model: "aft-shakespeare", messages: [{ role: "user", content: "Good morrow" }],
                    max_tokens: 10, temperature: 1, seed: 9, n: 3 };
  const whole = await client.chat.completions.create(several);
  assert.deepEqual(whole.choices.map((c) => c.index), [0, 1, 2]);
  assert.equal(whole.usage.prompt_tokens, unary.usage.prompt_tokens);
  assert.equal(whole.usage.completion_tokens, 30);
  const texts = ["", "", ""];
  const finishes = [null, null, null];
  for await (const chunk of await client.chat.completions.create({ ...several, stream: true })) {
    for (const c of chunk.choices) {
      if (c.delta?.content) texts[c.index] += c.delta.content;
      if (c.finish_reason) finishes[c.index] = c.finish_reason;
    }
  }
  assert.deepEqual(texts, whole.choices.map((c) => c.message.content));
  assert.deepEqual(finishes, ["length", "length", "length"]);

  // A response continued by previous_response_id: the state is reused.
  const first = await client.responses.create({
    model: "aft-shakespeare", input: "Good morrow", max_output_tokens: 16, temperature: 0,
  });
  assert.ok(first.id.startsWith("resp_"));
  assert.equal(typeof first.output_text, "string");
  const second = await client.responses.create({
    model: "aft-shakespeare", input: "And then?", max_output_tokens: 8,
    previous_response_id: first.id,
  });
  assert.equal(second.previous_response_id, first.id);
  assert.equal(second.usage.input_tokens_details.cached_tokens, first.usage.total_tokens);
  // Cached tokens are part of the input; total = input + output.
  assert.ok(second.usage.input_tokens > second.usage.input_tokens_details.cached_tokens);
  assert.equal(second.usage.total_tokens, second.usage.input_tokens + second.usage.output_tokens);

  // Our own output sent back as input (the Responses API's stateless pattern).
  const replayed = await client.responses.create({
    model: "aft-shakespeare", max_output_tokens: 8, temperature: 0,
    input: [{ role: "user", content: "Good morrow" }, ...first.output,
            { role: "user", content: "And then?" }],
  });
  const reference = await client.responses.create({
    model: "aft-shakespeare", max_output_tokens: 8, temperature: 0,
    input: [{ role: "user", content: "Good morrow" }, { role: "assistant", content: first.output_text },
            { role: "user", content: "And then?" }],
  });
  assert.equal(replayed.output_text, reference.output_text);

  // Streamed responses events through the SDK.
  const events = [];
  const rstream = await client.responses.create({
    model: "aft-shakespeare", input: "Speak", max_output_tokens: 8, stream: true,
    previous_response_id: second.id,
  });
  for await (const event of rstream) events.push(event);
  assert.equal(events[0].type, "response.created");
  assert.ok(["response.completed", "response.incomplete"].includes(events.at(-1).type));
  events.forEach((e, i) => assert.equal(e.sequence_number, i));

  // Errors in OpenAI's shape become the SDK's typed errors.
  await assert.rejects(
    client.chat.completions.create({ model: "nope", messages: [{ role: "user", content: "x" }] }),
    (e) => e instanceof OpenAI.NotFoundError);
  await assert.rejects(
    client.chat.completions.create({ messages: [{ role: "user", content: "x" }], n: 17 }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === "n");
  console.log(`PASS: openai npm client: ${deltas} chat deltas, ` +
              `response ${second.id} continued with ${second.usage.input_tokens_details.cached_tokens} cached tokens`);
});
