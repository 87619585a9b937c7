// Node host: a diffusers folder on disk as a FolderReader. A link that loops or leads nowhere is named as
// such (not reported as a missing file), and a JSON file that does not parse says where, in plain words.
import { lstatSync, readFileSync, readlinkSync, statSync } from 'node:fs';
import { basename, join } from 'node:path';
import { needRegularFile, NodeFileSource } from '../io/source-node.ts';
import { jsonSyntaxProblem } from '../util/describe.ts';
import type { FolderReader } from './inspect.ts';
import type { Json } from './source.ts';

/** Whether `path` exists; a link there that loops or dangles is an error naming it (what is there is not what was meant). */
function exists(path: string): boolean {
  try {
    statSync(path);
    return true;
  } catch (e) {
    let link: boolean;
    try {
      link = lstatSync(path).isSymbolicLink();
    } catch {
      return false; // nothing there at all
    }
    if (!link) return false;
    if ((e as NodeJS.ErrnoException).code === 'ELOOP') throw new Error(`${path} is a link that loops back on itself: fix or remove the link`, { cause: e });
    throw new Error(`${path} is a link to ${readlinkSync(path)}, which does not exist: fix or remove the link`, { cause: e });
  }
}

function readJson(path: string): Json {
  needRegularFile(path);
  const text = readFileSync(path, 'utf8');
  try {
    return JSON.parse(text) as Json;
  } catch (e) {
    throw new SyntaxError(`${jsonSyntaxProblem(e, text)}: the file is damaged or cut short; get it again`, { cause: e });
  }
}

export function nodeFolder(dir: string): FolderReader {
  return {
    name: basename(dir),
    exists: async (p) => exists(join(dir, p)),
    readJson: async (p) => readJson(join(dir, p)),
    open: (p) => NodeFileSource.open(join(dir, p)),
  };
}
