/**
 * Answers in the Worker's one error shape, `{"error": {"code", "message"}}` (openapi.yaml,
 * `Error`), and the request body read under a byte limit.
 */

export class HttpError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

export function json(body: unknown, status = 200, headers: HeadersInit = {}): Response {
  return new Response(JSON.stringify(body), {
    status,
    headers: { "content-type": "application/json", "cache-control": "no-store", ...headers },
  });
}

export function failure(status: number, code: string, message: string): Response {
  return json({ error: { code, message } }, status);
}

export function answer(error: HttpError): Response {
  return failure(error.status, error.code, error.message);
}

/**
 * The body as text, refused past `limit` bytes: by its Content-Length before reading a
 * byte, else while reading (a chunked body has none), so a huge body is never buffered.
 */
export async function readBody(request: Request, limit: number): Promise<string> {
  const declared = request.headers.get("content-length");
  if (declared !== null && !(Number(declared) <= limit)) {
    throw new HttpError(413, "body_too_large", `the body is over ${limit} bytes`);
  }
  if (request.body === null) return "";
  const reader = request.body.getReader();
  const chunks: Uint8Array[] = [];
  let total = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    total += value.byteLength;
    if (total > limit) {
      await reader.cancel();
      throw new HttpError(413, "body_too_large", `the body is over ${limit} bytes`);
    }
    chunks.push(value);
  }
  const bytes = new Uint8Array(total);
  let offset = 0;
  for (const chunk of chunks) {
    bytes.set(chunk, offset);
    offset += chunk.byteLength;
  }
  try {
    return new TextDecoder("utf-8", { fatal: true, ignoreBOM: false }).decode(bytes);
  } catch {
    throw new HttpError(400, "invalid_body", "the body is not UTF-8");
  }
}

/** At most `limit` bytes of `stream`; the rest is not read. */
export function capped(stream: ReadableStream<Uint8Array>, limit: number): ReadableStream<Uint8Array> {
  const reader = stream.getReader();
  let left = limit;
  return new ReadableStream<Uint8Array>({
    async pull(controller) {
      const next = left > 0 ? await reader.read() : { done: true as const, value: undefined };
      if (next.done === true) {
        controller.close();
        await reader.cancel();
        return;
      }
      const part = next.value.byteLength > left ? next.value.subarray(0, left) : next.value;
      left -= part.byteLength;
      controller.enqueue(part);
    },
    cancel: (reason) => reader.cancel(reason),
  });
}
