// Node host: the download cache as files; partial downloads in <key>.part, renamed when complete.
import { existsSync, mkdirSync } from 'node:fs';
import { appendFile, rename, rm, stat } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import type { DownloadCache } from './hub.ts';
import { NodeFileSource } from './source-node.ts';

export function nodeDownloadCache(root: string): DownloadCache {
  const file = (key: string) => join(root, ...key.split('/').map((p) => p.replace(/[^A-Za-z0-9._@-]/g, '_')));
  const part = (key: string) => `${file(key)}.part`;
  return {
    async partialSize(key) {
      return existsSync(part(key)) ? (await stat(part(key))).size : 0;
    },
    async appendPartial(key, chunk) {
      mkdirSync(dirname(part(key)), { recursive: true });
      await appendFile(part(key), chunk);
    },
    async dropPartial(key) {
      await rm(part(key), { force: true });
    },
    async commit(key) {
      mkdirSync(dirname(file(key)), { recursive: true });
      if (!existsSync(part(key))) await appendFile(part(key), new Uint8Array(0));
      await rename(part(key), file(key));
    },
    async open(key) {
      return existsSync(file(key)) ? NodeFileSource.open(file(key)) : null;
    },
  };
}
