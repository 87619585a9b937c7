// What a drop gives: the files of a dropped folder with their paths (for models and for photos with a masks/ folder).

/** Files of a dropped folder (DataTransferItem.webkitGetAsEntry), with paths relative to the drop. */
export async function filesFromDrop(items: DataTransferItemList): Promise<{ files: { path: string; file: File }[]; folder: string | null }> {
  const out: { path: string; file: File }[] = [];
  let folder: string | null = null;
  const walk = async (entry: FileSystemEntry, prefix: string): Promise<void> => {
    if (entry.isFile) {
      const file = await new Promise<File>((res, rej) => (entry as FileSystemFileEntry).file(res, rej));
      out.push({ path: prefix + entry.name, file });
    } else if (entry.isDirectory) {
      const reader = (entry as FileSystemDirectoryEntry).createReader();
      for (;;) {
        const batch = await new Promise<FileSystemEntry[]>((res, rej) => reader.readEntries(res, rej));
        if (!batch.length) break;
        for (const e of batch) await walk(e, `${prefix}${entry.name}/`);
      }
    }
  };
  const entries = Array.from(items)
    .map((i) => i.webkitGetAsEntry?.())
    .filter((e): e is FileSystemEntry => !!e);
  for (const e of entries) {
    if (e.isDirectory) folder = e.name;
    await walk(e, '');
  }
  return { files: out, folder };
}
