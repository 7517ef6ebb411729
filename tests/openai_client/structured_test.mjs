// Structured output as applications ask for it (docs/structured-output.md), against the
// real fwserve, with a JSON schema validator from npm (ajv, pinned by package-lock.json)
// as the oracle, never our own:
//   - the Vercel AI SDK's generateObject and streamObject (zod schemas, nested, with
//     arrays, enums and nullable fields) through chat completions (response_format
//     json_schema), the Responses API (text.format) and the openai-compatible provider;
//   - LangChain's withStructuredOutput, by JSON schema and by a forced function call;
//   - raw requests: >= 200 objects per model at temperature 1 with random seeds, each
//     parsed and validated unless max_tokens cut it; json_object; a forced tool call,
//     whole and streamed as tool-call deltas; a keyword outside the subset is a 400.
// Two vocabularies: the shipped byte-level model and an RWKV-7 with the 65,536-token
// world vocabulary (random weights, written by `fwmodel init`).
//
// Usage: node structured_test.mjs FWSERVE_BINARY FWMODEL_BINARY MODEL_DIR WORLD_VOCAB
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { generateObject, streamObject } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { ChatOpenAI } from "@langchain/openai";
import { z } from "zod";
import Ajv2020 from "ajv/dist/2020.js";
import addFormats from "ajv-formats";
import { withServer } from "./fwserve_process.mjs";

const [fwserve, fwmodel, shippedDir, worldVocab] = process.argv.slice(2);
const OBJECTS = Number(process.env.STRUCTURED_OBJECTS ?? 200);

const ajv = new Ajv2020({ allErrors: true, strict: false });
addFormats(ajv);

// What the SDK tests ask for: nested, with arrays, enums and a nullable field. Strings and
// arrays are bounded so that a reply ends well within max_tokens.
const Character = z.object({
  name: z.string().max(12),
  role: z.enum(["king", "queen", "fool", "ghost"]),
  age: z.number().int().min(0).max(120),
  alive: z.boolean(),
  lines: z.array(z.string().max(16)).max(3),
  home: z.object({ city: z.string().max(10), act: z.number().int().min(1).max(5) }),
  motto: z.string().max(10).nullable(),
});
const characterSchema = z.toJSONSchema(Character);

// The raw-request schemas: the one above, a recursive tree ($defs and $ref), anyOf of
// objects, a pattern and a format.
const rawSchemas = {
  character: characterSchema,
  tree: {
    $defs: {
      node: {
        type: "object",
        properties: {
          label: { type: "string", enum: ["a", "b", "c"] },
          children: { type: "array", items: { $ref: "#/$defs/node" }, maxItems: 2 },
        },
        required: ["label", "children"],
        additionalProperties: false,
      },
    },
    $ref: "#/$defs/node",
  },
  event: {
    type: "object",
    properties: {
      kind: { anyOf: [
        { type: "object", properties: { duel: { type: "boolean" } }, required: ["duel"],
          additionalProperties: false },
        { type: "object", properties: { feast: { type: "integer", minimum: 0, maximum: 99 } },
          required: ["feast"], additionalProperties: false },
      ] },
      code: { type: "string", pattern: "^[A-Z]{2}-[0-9]{3}$" },
      day: { type: "string", format: "date" },
      note: { type: ["string", "null"], maxLength: 8 },
    },
    required: ["kind", "code", "day", "note"],
    additionalProperties: false,
  },
};

async function post(base, route, body) {
  const r = await fetch(`${base}${route}`, {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
  });
  return { status: r.status, body: await r.text() };
}

// Each raw schema, `count` objects at temperature 1 with random seeds, 8 at a time: every
// reply that ended by itself (finish_reason "stop") parses and validates.
async function rawObjects(base, model, count, label) {
  const validators = Object.fromEntries(
    Object.entries(rawSchemas).map(([name, schema]) => [name, ajv.compile(schema)]));
  const names = Object.keys(rawSchemas);
  let whole = 0, cut = 0;
  for (let start = 0; start < count; start += 8) {
    await Promise.all(Array.from({ length: Math.min(8, count - start) }, async (_, j) => {
      const i = start + j;
      const name = names[i % names.length];
      const r = await post(base, "/v1/chat/completions", {
        model, messages: [{ role: "user", content: `A ${name}, please.` }],
        temperature: 1.0, seed: Math.floor(Math.random() * 2 ** 31), max_tokens: 400,
        response_format: { type: "json_schema",
                           json_schema: { name, schema: rawSchemas[name], strict: true } },
      });
      assert.equal(r.status, 200, `${label} ${name}: ${r.body}`);
      const reply = JSON.parse(r.body);
      const choice = reply.choices[0];
      if (choice.finish_reason === "length") { cut++; return; }
      assert.equal(choice.finish_reason, "stop", `${label} ${name}`);
      let object;
      try {
        object = JSON.parse(choice.message.content);
      } catch (e) {
        assert.fail(`${label} ${name}: the reply does not parse: ${choice.message.content}`);
      }
      const valid = validators[name](object);
      assert.ok(valid, `${label} ${name}: ${JSON.stringify(validators[name].errors)} in ` +
                       choice.message.content);
      whole++;
    }));
  }
  console.log(`${label}: ${whole} objects parsed and validated, ${cut} cut by max_tokens`);
  assert.ok(whole >= count * 0.9, `${label}: only ${whole} of ${count} ended by themselves`);
  return whole;
}

async function checkModel(base, model, label) {
  // The AI SDK: generateObject and streamObject, by chat completions, Responses and the
  // openai-compatible provider.
  const openai = createOpenAI({ baseURL: `${base}/v1`, apiKey: "unused" });
  const compatible = createOpenAICompatible({ name: "fwserve", baseURL: `${base}/v1`,
                                              apiKey: "unused", supportsStructuredOutputs: true });
  const validate = ajv.compile(characterSchema);
  for (const [variant, sdkModel] of [["chat", openai.chat(model)], ["responses", openai(model)],
                                     ["openai-compatible", compatible.chatModel(model)]]) {
    for (let seed = 1; seed <= 3; seed++) {
      const { object } = await generateObject({
        model: sdkModel, schema: Character, prompt: "Name a character of the play.",
        temperature: 1.0, seed, maxOutputTokens: 400, maxRetries: 0,
      });
      assert.ok(validate(object), `${label} ${variant} generateObject: ` +
                                  JSON.stringify(validate.errors) + JSON.stringify(object));
    }
    const stream = streamObject({
      model: sdkModel, schema: Character, prompt: "Another character.", temperature: 1.0,
      seed: 7, maxOutputTokens: 400, maxRetries: 0,
    });
    let partials = 0;
    for await (const partial of stream.partialObjectStream) {
      assert.equal(typeof partial, "object");
      partials++;
    }
    const object = await stream.object;
    assert.ok(partials > 1, `${label} ${variant} streamObject: ${partials} partial objects`);
    assert.ok(validate(object), `${label} ${variant} streamObject: ${JSON.stringify(object)}`);
  }
  console.log(`${label}: AI SDK generateObject and streamObject validated`);

  // LangChain: withStructuredOutput by JSON schema and by a forced function call.
  for (const method of ["jsonSchema", "functionCalling"]) {
    const llm = new ChatOpenAI({ model, apiKey: "unused", temperature: 1, maxTokens: 400,
                                 maxRetries: 0, configuration: { baseURL: `${base}/v1` } });
    const structured = llm.withStructuredOutput(Character, { method, name: "character" });
    for (let i = 0; i < 3; i++) {
      const object = await structured.invoke("Name a character of the play.");
      assert.ok(validate(object), `${label} LangChain ${method}: ` +
                                  JSON.stringify(validate.errors) + JSON.stringify(object));
    }
  }
  console.log(`${label}: LangChain withStructuredOutput validated (jsonSchema, functionCalling)`);

  // json_object: any JSON object.
  for (let seed = 1; seed <= 5; seed++) {
    const r = await post(base, "/v1/chat/completions", {
      model, messages: [{ role: "user", content: "JSON!" }], temperature: 1.0, seed,
      max_tokens: 300, response_format: { type: "json_object" },
    });
    assert.equal(r.status, 200, r.body);
    const choice = JSON.parse(r.body).choices[0];
    if (choice.finish_reason === "stop") {
      const object = JSON.parse(choice.message.content);
      assert.ok(object !== null && typeof object === "object" && !Array.isArray(object),
                choice.message.content);
    }
  }

  // A forced tool call, whole and streamed: the streamed deltas add up to the same call.
  const tools = [{ type: "function", function: { name: "cast", description: "Cast a role",
                                                  parameters: characterSchema } },
                 { type: "function", function: { name: "exit", parameters: {
                   type: "object", properties: { pursued_by: { type: "string", enum: ["bear"] } },
                   required: ["pursued_by"], additionalProperties: false } } }];
  const toolBody = { model, messages: [{ role: "user", content: "Cast someone." }], tools,
                     tool_choice: "required", temperature: 1.0, seed: 11, max_tokens: 400 };
  const whole = JSON.parse((await post(base, "/v1/chat/completions", toolBody)).body);
  const call = whole.choices[0].message.tool_calls[0];
  assert.equal(whole.choices[0].finish_reason, "tool_calls", JSON.stringify(whole));
  assert.ok(["cast", "exit"].includes(call.function.name), JSON.stringify(call));
  const args = JSON.parse(call.function.arguments);
  const toolSchema = tools.find((t) => t.function.name === call.function.name).function.parameters;
  assert.ok(ajv.validate(toolSchema, args), `${label} tool call: ${call.function.arguments}`);
  const streamed = await post(base, "/v1/chat/completions", { ...toolBody, stream: true });
  let name = "", argumentsText = "", finish = null;
  for (const line of streamed.body.split("\n")) {
    if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
    const choice = JSON.parse(line.slice(6)).choices[0];
    if (!choice) continue;
    for (const delta of choice.delta?.tool_calls ?? []) {
      name += delta.function?.name ?? "";
      argumentsText += delta.function?.arguments ?? "";
    }
    finish = choice.finish_reason ?? finish;
  }
  assert.equal(name, call.function.name, `${label} streamed tool name`);
  assert.equal(argumentsText, call.function.arguments, `${label} streamed tool arguments`);
  assert.equal(finish, "tool_calls");
  console.log(`${label}: forced tool call validated, whole and streamed`);

  // Outside the subset: a 400 naming the keyword.
  const refused = await post(base, "/v1/chat/completions", {
    model, messages: [{ role: "user", content: "x" }],
    response_format: { type: "json_schema", json_schema: { name: "x", schema: {
      type: "object", patternProperties: { "^a": { type: "string" } } } } },
  });
  assert.equal(refused.status, 400, refused.body);
  assert.match(refused.body, /patternProperties/);

  return rawObjects(base, model, OBJECTS, label);
}

// The world-vocabulary model: an RWKV-7 with random weights and the world vocabulary.
const work = fs.mkdtempSync(path.join(os.tmpdir(), "fwserve-structured-"));
try {
  const worldDir = path.join(work, "rwkv7-world");
  const configPath = path.join(work, "rwkv7-world.json");
  fs.writeFileSync(configPath, JSON.stringify({
    format_version: 1, architecture: "rwkv7", d_model: 64, n_layers: 1, n_heads: 1, d_ff: 64,
    vocab_size: 65536, tokenizer: "rwkv_world", decay_low_rank_dim: 4, a_low_rank_dim: 4,
    v_low_rank_dim: 4, gate_low_rank_dim: 4, tie_embeddings: true }));
  execFileSync(fwmodel, ["init", worldDir, "--config", configPath, "--seed", "3"],
               { stdio: "ignore" });
  fs.copyFileSync(worldVocab, path.join(worldDir, "rwkv_vocab_v20230424.txt"));

  await withServer(fwserve, shippedDir, (base) => checkModel(base, "aft-shakespeare", "byte vocabulary"));
  await withServer(fwserve, worldDir, (base) => checkModel(base, "rwkv7-world", "world vocabulary"));
} finally {
  fs.rmSync(work, { recursive: true, force: true });
}
