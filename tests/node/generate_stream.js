// A Node.js client of llmserve.v1.GatewayService, built from protos/ as any client would be.
//
//   node generate_stream.js HOST:PORT '{"prompt": "Hello", "sampling": {"max_tokens": 8}}'
//
// Calls GenerateStream with the GenerateParams given as JSON (proto field names), then prints
// one JSON object on stdout: the x-request-id metadata and every stream message. Exits 1 with
// the gRPC status on stderr when the call fails.
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");
const DEADLINE_MS = 60_000;

function loadGateway() {
  const definition = protoLoader.loadSync("llmserve/v1/gateway.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto: finish_reason, not finishReason
    enums: String, // FINISH_REASON_LENGTH, not 2
    longs: Number, // uint64 nanoseconds fit a double for any realistic duration
    defaults: false, // an unset message field (e.g. result before the last message) stays absent
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).llmserve.v1.GatewayService;
}

function main() {
  const [address, paramsJson] = process.argv.slice(2);
  const GatewayService = loadGateway();
  const client = new GatewayService(address, grpc.credentials.createInsecure());
  const call = client.GenerateStream(
    { params: JSON.parse(paramsJson) },
    { deadline: new Date(Date.now() + DEADLINE_MS) },
  );
  const messages = [];
  let requestId = null;
  call.on("metadata", (metadata) => {
    [requestId] = metadata.get("x-request-id");
  });
  call.on("data", (message) => messages.push(message));
  call.on("error", (error) => {
    process.stderr.write(`${grpc.status[error.code]}: ${error.details}\n`);
    process.exitCode = 1;
    client.close();
  });
  call.on("end", () => {
    process.stdout.write(JSON.stringify({ request_id_metadata: requestId, messages }) + "\n");
    client.close();
  });
}

main();
