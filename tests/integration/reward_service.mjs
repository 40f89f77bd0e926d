// A Belayer reward service in Node.js, written from docs/protocol.md §5.1 alone:
// connect with the `reward` identity, answer RewardRequest.v1 on belayer.reward.<name> with
// RewardReply.v1. Score: 1 when the response's last "Answer:" line is the reference answer;
// a request without the response's token ids or the trajectory id is answered an error.
// Usage: node reward_service.mjs NATS_URL SEED_FILE NAME COUNT_FILE
import { readFileSync, writeFileSync } from "node:fs";
import { connect, nkeyAuthenticator } from "nats";
import { decode, encode } from "@msgpack/msgpack";

const [url, seedFile, name, countFile] = process.argv.slice(2);
const seed = readFileSync(seedFile, "utf8").trim();
const nc = await connect({ servers: url, authenticator: nkeyAuthenticator(new TextEncoder().encode(seed)) });
const sub = nc.subscribe(`belayer.reward.${name}`, { queue: name });
let served = 0;
writeFileSync(countFile, "0");
console.log(`ready ${name}`);
for await (const m of sub) {
  const req = decode(m.data);
  if (req.type !== "RewardRequest.v1") {
    m.respond(encode({ type: "ErrorReply.v1", code: "invalid_request", message: "expected RewardRequest.v1", retryable: false, data: {} }));
    continue;
  }
  const ids = req.response_token_ids;
  if (!Array.isArray(ids) || ids.length === 0 || !ids.every(Number.isInteger) || !req.trajectory_id) {
    m.respond(encode({ type: "ErrorReply.v1", code: "invalid_request", message: "no response_token_ids or trajectory_id", retryable: false, data: {} }));
    continue;
  }
  const answers = req.response.split("\n").filter((l) => l.startsWith("Answer:"));
  const last = answers.length ? answers[answers.length - 1].slice("Answer:".length).trim() : null;
  const score = last !== null && last === req.answer ? 1 : 0;
  m.respond(encode({ type: "RewardReply.v1", score, metrics: { chars: req.response.length, tokens: ids.length } }));
  served += 1;
  writeFileSync(countFile, String(served));
}
