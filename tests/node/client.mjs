// The any-language client check: drives a running Tandem mesh from Node.js with @grpc/grpc-js and
// @grpc/proto-loader, using nothing of Tandem but its .proto files. Run by
// tests/integration/test_node_client.py, or by hand against `tandem up`:
//
//   node tests/node/client.mjs --gateway 127.0.0.1:50050 --vault 127.0.0.1:50051 \
//     --protos protos --google-protos <dir holding google/rpc/status.proto> [--health-protos <dir>]
//
// Checks, one output line each, then a JSON summary line; exits non-zero on the first failure:
//   health       grpc.health.v1.Health/Check on the gateway answers SERVING;
//   server_info  GatewayService/GetServerInfo (public) reports all five services serving;
//   error_model  VaultService/PutSecret without credentials fails UNAUTHENTICATED, and the
//                grpc-status-details-bin trailer decodes to google.rpc.Status carrying a
//                google.rpc.ErrorInfo with reason MISSING_CREDENTIALS in domain tandem.dev.

import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { createRequire } from "node:module";
import { parseArgs } from "node:util";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

// protobufjs is what proto-loader parses .proto files with; resolve it through proto-loader so this works
// whether or not npm hoisted it. It decodes the google.rpc.Status trailer, which no RPC returns as a
// message and so has no deserializer in the package definition.
const requireFromLoader = createRequire(createRequire(import.meta.url).resolve("@grpc/proto-loader"));
const protobuf = requireFromLoader("protobufjs");

const DEADLINE_MS = 10_000;
const EXPECTED_COMPONENTS = ["gateway", "vault", "scheduler", "taskapp-proxy", "events"];
const ERROR_INFO_TYPE_URL = "type.googleapis.com/google.rpc.ErrorInfo";

// grpc.health.v1 as published in grpc/grpc-proto (src/proto/grpc/health/v1/health.proto), used when no
// --health-protos folder is given: the Python grpcio-health-checking wheel ships only generated code.
const HEALTH_PROTO = `syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
message HealthListRequest {}
message HealthListResponse { map<string, HealthCheckResponse> statuses = 1; }
service Health {
  rpc Check(HealthCheckRequest) returns (HealthCheckResponse);
  rpc List(HealthListRequest) returns (HealthListResponse);
  rpc Watch(HealthCheckRequest) returns (stream HealthCheckResponse);
}
`;

class CheckFailed extends Error {}

function fail(check, message) {
  throw new CheckFailed(`${check}: ${message}`);
}

function options() {
  const { values } = parseArgs({
    options: {
      gateway: { type: "string" },
      vault: { type: "string" },
      protos: { type: "string" },
      "google-protos": { type: "string" },
      "health-protos": { type: "string" },
    },
    strict: true,
  });
  for (const required of ["gateway", "vault", "protos", "google-protos"]) {
    if (!values[required]) {
      throw new CheckFailed(`usage: missing --${required}`);
    }
  }
  return values;
}

function protoFilesUnder(root) {
  const found = [];
  for (const entry of fs.readdirSync(root, { withFileTypes: true, recursive: true })) {
    if (entry.isFile() && entry.name.endsWith(".proto")) {
      found.push(path.relative(root, path.join(entry.parentPath ?? entry.path, entry.name)));
    }
  }
  return found.sort();
}

function healthIncludeDir(given) {
  if (given) {
    return { dir: given, cleanup: () => {} };
  }
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "tandem-health-proto-"));
  fs.mkdirSync(path.join(dir, "grpc", "health", "v1"), { recursive: true });
  fs.writeFileSync(path.join(dir, "grpc", "health", "v1", "health.proto"), HEALTH_PROTO);
  return { dir, cleanup: () => fs.rmSync(dir, { recursive: true, force: true }) };
}

function deadline() {
  return new Date(Date.now() + DEADLINE_MS);
}

// One unary call with a deadline; settles with { error, reply } so callers can expect failures too.
function call(client, method, request) {
  return new Promise((resolve) => {
    client[method](request, new grpc.Metadata(), { deadline: deadline() }, (error, reply) => {
      resolve({ error, reply });
    });
  });
}

function describe(error) {
  return `${grpc.status[error.code] ?? error.code}: ${error.details}`;
}

// A call that must succeed.
async function unary(client, method, request, check) {
  const { error, reply } = await call(client, method, request);
  if (error) fail(check, `${method} failed with ${describe(error)}`);
  return reply;
}

async function checkHealth(Health, target) {
  const client = new Health(target, grpc.credentials.createInsecure());
  try {
    const reply = await unary(client, "Check", { service: "" }, "health");
    if (reply.status !== "SERVING") fail("health", `gateway answered ${reply.status}, want SERVING`);
    return reply.status;
  } finally {
    client.close();
  }
}

async function checkServerInfo(GatewayService, target) {
  const client = new GatewayService(target, grpc.credentials.createInsecure());
  try {
    const reply = await unary(client, "GetServerInfo", {}, "server_info");
    const info = reply.server_info;
    if (!info) fail("server_info", "response has no server_info");
    const components = info.services.map((s) => s.component);
    if (JSON.stringify(components) !== JSON.stringify(EXPECTED_COMPONENTS)) {
      fail("server_info", `components ${JSON.stringify(components)}, want ${JSON.stringify(EXPECTED_COMPONENTS)}`);
    }
    const notServing = info.services.filter((s) => s.serving_status !== "SERVING_STATUS_SERVING");
    if (notServing.length > 0) {
      fail("server_info", `not serving: ${notServing.map((s) => `${s.component}=${s.serving_status}`).join(", ")}`);
    }
    if (info.all_serving !== true) fail("server_info", "all_serving is not true");
    return { components, version: info.version, topology: info.topology };
  } finally {
    client.close();
  }
}

async function checkErrorModel(VaultService, target, root) {
  const client = new VaultService(target, grpc.credentials.createInsecure());
  let outcome;
  try {
    const request = {
      parent: "orgs/acme",
      secret_id: "env-key",
      key_id: "k1",
      ciphertext: Buffer.alloc(80, "x"),
    };
    outcome = await call(client, "PutSecret", request);
  } finally {
    client.close();
  }
  const { error, reply } = outcome;
  if (!error) fail("error_model", `PutSecret without credentials succeeded: ${JSON.stringify(reply)}`);
  if (error.code !== grpc.status.UNAUTHENTICATED) {
    fail("error_model", `PutSecret failed with ${describe(error)}, want UNAUTHENTICATED`);
  }
  const raw = error.metadata?.get("grpc-status-details-bin") ?? [];
  if (raw.length !== 1 || !Buffer.isBuffer(raw[0])) {
    fail("error_model", `want one grpc-status-details-bin trailer, got ${raw.length}`);
  }
  const Status = root.lookupType("google.rpc.Status");
  const ErrorInfo = root.lookupType("google.rpc.ErrorInfo");
  const status = Status.decode(raw[0]);
  if (status.code !== grpc.status.UNAUTHENTICATED) {
    fail("error_model", `google.rpc.Status code ${status.code} differs from the call's status`);
  }
  const infos = status.details.filter((any) => any.type_url === ERROR_INFO_TYPE_URL);
  if (infos.length !== 1) {
    fail("error_model", `want one ErrorInfo detail, got types ${JSON.stringify(status.details.map((a) => a.type_url))}`);
  }
  const info = ErrorInfo.decode(infos[0].value);
  if (info.reason !== "MISSING_CREDENTIALS") fail("error_model", `reason ${JSON.stringify(info.reason)}, want MISSING_CREDENTIALS`);
  if (info.domain !== "tandem.dev") fail("error_model", `domain ${JSON.stringify(info.domain)}, want tandem.dev`);
  return { code: grpc.status[error.code], reason: info.reason, domain: info.domain, message: status.message };
}

async function main() {
  const args = options();
  const protosDir = path.resolve(args.protos);
  const googleDir = path.resolve(args["google-protos"]);
  const health = healthIncludeDir(args["health-protos"] && path.resolve(args["health-protos"]));
  try {
    const includeDirs = [protosDir, googleDir, health.dir];
    const files = [
      ...protoFilesUnder(path.join(protosDir)),
      "google/rpc/status.proto",
      "google/rpc/error_details.proto",
      "grpc/health/v1/health.proto",
    ];
    const loaderOptions = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true, includeDirs };
    const definition = protoLoader.loadSync(files, loaderOptions);
    const loaded = grpc.loadPackageDefinition(definition);
    console.log(`ok load ${files.length} proto files`);

    // The same files through protobufjs itself, for decoding the status trailer.
    const root = new protobuf.Root();
    root.resolvePath = (_origin, target) => {
      for (const dir of includeDirs) {
        const candidate = path.join(dir, target);
        if (fs.existsSync(candidate)) return candidate;
      }
      return target;
    };
    root.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"], { keepCase: true });

    const summary = {};
    summary.health = await checkHealth(loaded.grpc.health.v1.Health, args.gateway);
    console.log(`ok health ${summary.health}`);
    summary.server_info = await checkServerInfo(loaded.tandem.gateway.v1.GatewayService, args.gateway);
    console.log(`ok server_info ${summary.server_info.components.join(",")}`);
    summary.error_model = await checkErrorModel(loaded.tandem.vault.v1.VaultService, args.vault, root);
    console.log(`ok error_model ${summary.error_model.code} ${summary.error_model.reason}`);
    console.log(JSON.stringify({ ok: true, files: files.length, ...summary }));
  } finally {
    health.cleanup();
  }
}

main().then(
  () => process.exit(0),
  (error) => {
    const message = error instanceof CheckFailed ? error.message : error?.stack ?? String(error);
    console.error(`FAIL ${message}`);
    console.log(JSON.stringify({ ok: false, error: error?.message ?? String(error) }));
    process.exit(1);
  },
);
