// A Node.js client of GatewayService.GenerateStream (@grpc/grpc-js) that does not read its stream
// until told to: bench/bench_slow_reader.py's `node-grpc-js` client.
//
//   node never_read.js HOST:PORT MAX_TOKENS PROMPT
//
// Starts a completion of PROMPT, MAX_TOKENS tokens (ignore_eos), with no `data` listener, so the stream is
// never read, and prints "started" once the call's metadata came. A line on stdin then makes it
// read: it prints one JSON object, the messages and tokens it read and how the call ended.
"use strict";

const path = require("node:path");
const readline = require("node:readline");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");

function loadGateway() {
  const definition = protoLoader.loadSync("llmserve/v1/gateway.proto", { includeDirs: [PROTO_ROOT], keepCase: true });
  return grpc.loadPackageDefinition(definition).llmserve.v1.GatewayService;
}

function main() {
  const [address, maxTokens, prompt] = process.argv.slice(2);
  const GatewayService = loadGateway();
  const client = new GatewayService(address, grpc.credentials.createInsecure());
  const sampling = { max_tokens: Number(maxTokens), temperature: 0, ignore_eos: true };
  const call = client.GenerateStream({ params: { prompt, sampling, return_token_ids: true } });
  let status = "OK";
  let messages = 0;
  let tokens = 0;
  let reading = false;
  let closed = false;
  const lines = readline.createInterface({ input: process.stdin });
  const report = () => {
    process.stdout.write(JSON.stringify({ messages, tokens, status }) + "\n");
    lines.close();
    client.close();
  };
  call.on("metadata", () => process.stdout.write("started\n"));
  call.on("error", (error) => {
    status = `${grpc.status[error.code]}: ${error.details}`;
  });
  call.on("close", () => {  // a call that failed unread may close before the line comes
    closed = true;
    if (reading) report();
  });
  lines.once("line", () => {
    reading = true;
    call.on("data", (message) => {
      messages += 1;
      tokens += message.token_ids.length;
    });
    if (closed) report();
  });
}

main();
