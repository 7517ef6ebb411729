// Starts the real fwserve binary with --http-listen on a free loopback port for the SDK
// tests of this folder, and stops it at the end (SIGTERM; a non-zero exit fails the test).
//
// withServer(fwserve, modelDir, async (base) => {...}): `base` is "http://127.0.0.1:PORT".
import { spawn } from "node:child_process";
import net from "node:net";

// A free loopback TCP port (bound, read and closed).
export function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
    server.on("error", reject);
  });
}

// Resolves once `base`/health answers; throws if `child` exits first or after 30 s.
export async function waitHealthy(base, child) {
  for (let i = 0; i < 300; i++) {
    if (child.exitCode !== null) throw new Error(`fwserve exited with ${child.exitCode}`);
    try {
      const r = await fetch(`${base}/health`);
      if (r.ok) return;
    } catch {}
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error("fwserve did not become healthy");
}

export async function withServer(fwserve, model, fn) {
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  let log = "";
  const child = spawn(fwserve, ["--listen", "127.0.0.1:0", "--metrics-listen", "", "--model", model,
                                "--http-listen", `127.0.0.1:${port}`, "--threads", "1"],
                      { stdio: ["ignore", "ignore", "pipe"] });
  child.stderr.on("data", (d) => { log += d; });
  try {
    await waitHealthy(base, child);
    await fn(base);
  } catch (e) {
    console.error(log);
    throw e;
  } finally {
    child.kill("SIGTERM");
    const code = await new Promise((r) => child.exitCode !== null ? r(child.exitCode) : child.on("exit", r));
    if (code !== 0) { console.error(`fwserve exited with ${code}`); process.exitCode = 1; }
  }
}

// Raw HTTP: the greedy text of a chat completion of `messages` (the reference the SDKs'
// multi-turn texts are checked against: every route renders the same template).
export async function rawChatText(base, messages, maxTokens) {
  const r = await fetch(`${base}/v1/chat/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: "aft-shakespeare", messages, max_tokens: maxTokens, temperature: 0 }),
  });
  if (!r.ok) throw new Error(`raw chat: ${r.status} ${await r.text()}`);
  return (await r.json()).choices[0].message.content;
}
