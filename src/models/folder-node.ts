// Node host: a diffusers folder on disk as a FolderReader.
import { existsSync, readFileSync } from 'node:fs';
import { basename, join } from 'node:path';
import { needRegularFile, NodeFileSource } from '../io/source-node.ts';
import type { FolderReader } from './inspect.ts';

export function nodeFolder(dir: string): FolderReader {
  return {
    name: basename(dir),
    exists: async (p) => existsSync(join(dir, p)),
    readJson: async (p) => (needRegularFile(join(dir, p)), JSON.parse(readFileSync(join(dir, p), 'utf8'))),
    open: (p) => NodeFileSource.open(join(dir, p)),
  };
}
