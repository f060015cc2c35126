// A Node.js client of the gateway's OpenAI HTTP API, through the official `openai` package, as
// an application would use it.
//
//   node chat_stream.js http://127.0.0.1:8000/v1 '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}'
//
// Streams one chat completion with the request given as JSON (OpenAI's field names; the model
// defaults to the first one GET /models lists; stream and include_usage are added), then prints
// one JSON object on stdout: the model, the x-request-id header, the streamed text, how many
// chunks carried content, the last finish_reason and the usage chunk. Exits 1 with the client's
// error on stderr when the call fails.
"use strict";

const OpenAI = require("openai");

const TIMEOUT_MS = 60_000;

async function main() {
  const [baseURL, requestJson] = process.argv.slice(2);
  // No retries: a failure is the test's to see, not the client's to hide.
  const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: TIMEOUT_MS });
  const request = JSON.parse(requestJson);
  const model = request.model ?? (await client.models.list()).data[0].id;
  const { data: stream, response } = await client.chat.completions
    .create({ ...request, model, stream: true, stream_options: { include_usage: true } })
    .withResponse();
  let text = "";
  let contentChunks = 0;
  let finishReason = null;
  let usage = null;
  for await (const chunk of stream) {
    const [choice] = chunk.choices;
    if (choice?.delta?.content) {
      text += choice.delta.content;
      contentChunks += 1;
    }
    finishReason = choice?.finish_reason ?? finishReason;
    usage = chunk.usage ?? usage;
  }
  const result = {
    model,
    request_id: response.headers.get("x-request-id"),
    text,
    content_chunks: contentChunks,
    finish_reason: finishReason,
    usage,
  };
  process.stdout.write(JSON.stringify(result) + "\n");
}

main().catch((error) => {
  process.stderr.write(`${error.constructor.name}: ${error.message}\n`); // APIError's message starts with its status
  process.exitCode = 1;
});
