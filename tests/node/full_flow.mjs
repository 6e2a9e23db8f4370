// The full flow from Node.js, with nothing of Tandem but its .proto files (@grpc/grpc-js + @grpc/proto-loader)
// and libsodium's sealed box (libsodium-wrappers): create an organization with the admin credential, seal and
// upload the Task App's environment key to the organization's public key, register a running Task App,
// start an online-RL job from a TOML config, follow its events until it ends, list its checkpoints.
// Run by tests/integration/test_node_client.py, or by hand against `tandem up`:
//
//   TANDEM_ENV_KEY=<the app's key> node tests/node/full_flow.mjs --gateway 127.0.0.1:50050 \
//     --state-dir .tandem --protos protos --task-app-url http://127.0.0.1:8001 --config job.toml --org node
//
// One line per step, then a JSON summary line; exits non-zero on the first failure.

import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { parseArgs } from "node:util";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

const require = createRequire(import.meta.url);
const sodium = require("libsodium-wrappers");

const DEADLINE_MS = 30_000;
const TERMINAL = new Set(["STATE_SUCCEEDED", "STATE_FAILED", "STATE_CANCELLED"]);
const APP_ID = "single-turn";
const SECRET_ID = "single-turn-key";

class StepFailed extends Error {}

function fail(step, message) {
  throw new StepFailed(`${step}: ${message}`);
}

function options() {
  const { values } = parseArgs({
    options: {
      gateway: { type: "string" },
      "state-dir": { type: "string" },
      protos: { type: "string" },
      "task-app-url": { type: "string" },
      config: { type: "string" },
      org: { type: "string", default: "node" },
      "job-timeout-s": { type: "string", default: "300" },
    },
    strict: true,
  });
  for (const required of ["gateway", "state-dir", "protos", "task-app-url", "config"]) {
    if (!values[required]) throw new StepFailed(`usage: missing --${required}`);
  }
  if (!process.env.TANDEM_ENV_KEY) throw new StepFailed("usage: TANDEM_ENV_KEY (the Task App's key) is not set");
  return values;
}

function protoFilesUnder(root) {
  return fs
    .readdirSync(root, { withFileTypes: true, recursive: true })
    .filter((entry) => entry.isFile() && entry.name.endsWith(".proto"))
    .map((entry) => path.relative(root, path.join(entry.parentPath ?? entry.path, entry.name)))
    .sort();
}

function bearer(credential) {
  const metadata = new grpc.Metadata();
  metadata.set("authorization", `Bearer ${credential}`);
  return metadata;
}

function describe(error) {
  return `${grpc.status[error.code] ?? error.code}: ${error.details}`;
}

// One unary call that must succeed, with a deadline.
function unary(client, method, request, credential, step) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + DEADLINE_MS);
    client[method](request, bearer(credential), { deadline }, (error, reply) => {
      if (error) reject(new StepFailed(`${step}: ${method} failed with ${describe(error)}`));
      else resolve(reply);
    });
  });
}

// SubscribeEvents until the job's terminal StreamEnd. A new job may have no event yet (NOT_FOUND), and a
// dropped stream is reopened after the last seq seen: nothing is repeated or skipped.
async function follow(client, job, key, timeoutS) {
  const events = [];
  let end = null;
  const stop = Date.now() + timeoutS * 1000;
  while (end === null) {
    if (Date.now() > stop) fail("events", `the job did not end within ${timeoutS} s`);
    const afterSeq = events.length ? events[events.length - 1].seq : "0";
    const outcome = await new Promise((resolve) => {
      const call = client.SubscribeEvents(
        { job, after_seq: afterSeq, end_when_terminal: true },
        bearer(key),
        { deadline: new Date(stop) },
      );
      call.on("data", (response) => {
        if (response.events) events.push(...response.events.events);
        if (response.end) end = response.end;
      });
      call.on("error", (error) => resolve(error));
      call.on("end", () => resolve(null));
    });
    if (outcome && ![grpc.status.NOT_FOUND, grpc.status.UNAVAILABLE].includes(outcome.code)) {
      fail("events", `SubscribeEvents failed with ${describe(outcome)}`);
    }
    if (end === null) await new Promise((resolve) => setTimeout(resolve, 500));
  }
  return { events, end };
}

async function main() {
  const args = options();
  const org = args.org;
  const parent = `orgs/${org}`;
  const protosDir = path.resolve(args.protos);
  const definition = protoLoader.loadSync(protoFilesUnder(protosDir), {
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
    includeDirs: [protosDir],
  });
  const GatewayService = grpc.loadPackageDefinition(definition).tandem.gateway.v1.GatewayService;
  const client = new GatewayService(args.gateway, grpc.credentials.createInsecure());
  const summary = {};
  try {
    const admin = fs.readFileSync(path.join(args["state-dir"], "admin.key"), "utf8").trim();
    const made = await unary(client, "CreateOrg", { org_id: org }, admin, "org");
    const key = made.key;
    if (!key.startsWith("tdm_")) fail("org", "CreateOrg returned no API key");
    summary.org = made.org.name;
    console.log(`ok org ${made.org.name}`);

    const { key: orgKey } = await unary(client, "GetPublicKey", { parent }, key, "public_key");
    await sodium.ready;
    const ciphertext = Buffer.from(
      sodium.crypto_box_seal(Buffer.from(process.env.TANDEM_ENV_KEY), new Uint8Array(orgKey.public_key)),
    );
    const stored = await unary(
      client,
      "PutSecret",
      { parent, secret_id: SECRET_ID, key_id: orgKey.key_id, ciphertext },
      key,
      "secret",
    );
    summary.secret = stored.secret.name;
    console.log(`ok secret ${stored.secret.name} sealed to ${orgKey.key_id}`);

    const registered = await unary(
      client,
      "RegisterTaskApp",
      {
        parent,
        task_app_id: APP_ID,
        task_app: { base_url: args["task-app-url"], secret_name: `${parent}/secrets/${SECRET_ID}` },
      },
      key,
      "task_app",
    );
    const failed = registered.check_results.filter((r) => !r.passed).map((r) => r.check);
    if (failed.length) fail("task_app", `checks failed: ${failed.join(", ")}`);
    summary.task_app = registered.task_app.name;
    summary.checks = registered.check_results.length;
    console.log(`ok task_app ${registered.task_app.name} (${registered.check_results.length} checks passed)`);

    const toml = fs.readFileSync(args.config, "utf8");
    const { job } = await unary(client, "CreateJob", { parent, job_id: "node-rl", rl_config_toml: toml }, key, "job");
    summary.job = job.name;
    console.log(`ok job ${job.name} ${job.state}`);

    const { events, end } = await follow(client, job.name, key, Number(args["job-timeout-s"]));
    const seqs = events.map((e) => BigInt(e.seq));
    if (!seqs.every((seq, i) => i === 0 || seq > seqs[i - 1])) fail("events", `seqs out of order: ${seqs}`);
    const states = events.filter((e) => e.core === "job_state_changed").map((e) => e.job_state_changed.state);
    const steps = events.filter((e) => e.core === "train_step").map((e) => Number(e.train_step.step));
    if (!TERMINAL.has(end.terminal_state)) fail("events", `the stream ended in ${end.terminal_state}`);
    summary.terminal_state = end.terminal_state;
    summary.job_states = states;
    summary.train_steps = steps;
    summary.event_types = [...new Set(events.map((e) => e.type))];
    console.log(`ok events ${events.length} in seq order, ending ${end.terminal_state}`);

    const { checkpoints } = await unary(client, "ListCheckpoints", { parent: job.name }, key, "checkpoints");
    summary.checkpoints = checkpoints.map((c) => ({ name: c.name, step: Number(c.step) }));
    console.log(`ok checkpoints ${checkpoints.length}`);
    console.log(JSON.stringify({ ok: true, ...summary }));
  } finally {
    client.close();
  }
}

main().then(
  () => process.exit(0),
  (error) => {
    const message = error instanceof StepFailed ? error.message : error?.stack ?? String(error);
    console.error(`FAIL ${message}`);
    console.log(JSON.stringify({ ok: false, error: error?.message ?? String(error) }));
    process.exit(1);
  },
);
